"""What lctrain shows people: tables that fit any width, human numbers, plots, run summaries,
and the versions a number was measured with."""
