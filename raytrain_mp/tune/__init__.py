"""Learning-rate sweeps on Ray Tune under the linear scaling rule: ``raytrain-mp tune``.

Modules: ``config`` (``TuneConfig``: the search space, pure), ``sweep`` (runs the trials on Ray
Tune), ``report`` (table, plot and best config of a finished sweep; knows neither Ray nor Tune).

May import: the shared layer and ``raytrain_mp.data``, and ``raytrain_mp.ddp``, which it builds on:
every trial is one DDP run (``DDPConfig``, ``build_trainer``).
"""
