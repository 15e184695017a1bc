"""What lctrain shows people: tables that fit any width, human numbers, plots, run summaries.

    lctrain.report.table     Table / Column and their renderers (terminal, pipe, Markdown, CSV)
    lctrain.report.human     numbers as people read them (64K, 1.2 ms, 531 TFLOP/s, 6.74 B)
    lctrain.report.plotting  matplotlib made ready (or one sentence why not), length axes
    lctrain.report.runs      `lctrain report RUN_DIR...`: a summary of training runs
    lctrain.report.versions  `lctrain --version`, and what every run records about its machine
"""
