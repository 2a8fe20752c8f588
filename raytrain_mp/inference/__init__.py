"""After training: ``raytrain-mp eval``, ``predict`` and ``export`` of any checkpoint the trainers write.

Modules: ``config`` (``EvalConfig``, ``PredictConfig``, ``ExportConfig``: pure), ``checkpoint``
(``--checkpoint`` resolved to one complete checkpoint, and the model rebuilt from what the run
saved), ``images`` (image files preprocessed as the run's validation split is), ``evaluation``
(exact distributed evaluation on Ray Train workers), ``report`` (``eval.json``, the confusion-matrix
PNG and the predictions file), ``predict`` (top-k classes of image files), ``export`` (ONNX,
``torch.export`` and TorchScript files, checked against the model before they are written).

May import: the shared layer and ``raytrain_mp.data``, and ``raytrain_mp.ddp``, which it builds on:
``eval`` runs ddp's exact evaluation pieces (``ddp.distributed_eval.ShardSampler``,
``all_reduce_sum``) on Ray Train workers; and ``raytrain_mp.tune``,
whose results table names a sweep's best trial (``--checkpoint`` of an experiment folder).
"""
