"""`pipesgd train`: data-parallel training with `DistributedOptimizer` under mpirun.

`data` loads and shards the data sets, `loop` runs one training job and measures it,
`auto` picks its configuration with the timing model (`--config auto`), `cli` parses
the command line and prints the results. Models come from
`pipesgd.pipeline.models` (the MLP and the CNN are shared with pipeline training).
"""
