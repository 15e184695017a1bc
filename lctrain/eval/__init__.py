"""Evaluation of long-context models on the training's own distributed path.

- **Validation during training** (`lctrain.parallel.forward.validation_loss`): the mean token loss
  over the validation rows (``data.eval_source`` or ``data.eval_fraction``), every
  ``train.eval_every`` steps and after the last, with the run's dp × cp layout and attention,
  forward only.
- **``lctrain eval``** (`lctrain.eval.run.evaluate`): a run's checkpoint, an exported or any
  model folder, or a recipe's model, on every local GPU —

  * ``--task ppl``: loss and perplexity per position bucket (`lctrain.eval.tasks.run_ppl`);
  * ``--task passkey``: the passkey retrieval test at given lengths and depths
    (`lctrain.eval.passkey`), the prompt prefilled over the cp group and the answer decoded
    with each rank's keys and values left in place (`lctrain.eval.decode`);

  shown as tables and plots (`lctrain.eval.report`), stored as JSON (`lctrain.eval.result`).

This package's ``__init__`` imports nothing, so that the training runner can use
`lctrain.parallel.forward` while `lctrain.eval.run` uses the runner.
"""
