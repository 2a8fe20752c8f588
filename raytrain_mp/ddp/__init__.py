"""DDP on Ray Train: ``raytrain-mp ddp``.

Modules: ``config`` (``DDPConfig``), ``trainer`` (builds and fits the ``TorchTrainer``), ``loop``
(the per-worker training loop), ``sync_batchnorm`` (portable SyncBatchNorm), ``distributed_eval``
(evaluation that counts every sample once).

May import: the shared layer (``raytrain_mp.config``, ``checkpointing``, ``cluster``, ``storage``, ``errors``,
``lr_schedule``, ``models``, ``optim``) and ``raytrain_mp.data``; no other capability.
"""
