"""One training run, by job, in the order a run goes through them (``lra.run.train.train(cfg)``):

    train.py        train(cfg) -> record: prepare -> estimate -> setup -> claim -> restore -> loop -> finish
    setup.py        device and processes, model (prepare), then data and optimizer (the ``Run`` of the loop)
    distributed.py  torchrun's processes: rank 0 writes, the others follow
    init_from.py    another run's best weights as a fresh start (--init-from)
    folder.py       the run folder: its name, the claim and lock, config.json, metrics.jsonl
    checkpoint.py   what a checkpoint holds, saving it, a run restored from it
    estimate.py     what a long run will cost here, said before its data are read or generated
    trackers.py     TensorBoard and wandb beside metrics.jsonl
    loop.py         the steps, evaluation, and the schedule of logs and checkpoints
    signals.py      Ctrl-C and SIGTERM: said at once, a checkpoint and a stop; a second one stops now
    record.py       the result record's schema
    finished.py     a finished run read back (its config, record and best weights)
"""
