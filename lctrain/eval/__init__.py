"""``lctrain eval``: a run's checkpoint, a model folder or a recipe's model, evaluated on the
training's own distributed path — perplexity by position (``--task ppl``) or passkey retrieval
(``--task passkey``) — shown as tables and plots and stored as JSON."""
