"""Side-by-side benchmarks, each against the peer a user would pick instead: ``raytrain-mp bench``.

Modules: ``common`` (timing, summaries, machine description, torchrun launcher, atomic results),
``ddp`` with its bare torchrun peer ``ddp_bare``, ``pipeline`` (a package, one module a case)
with its ``torch.distributed.pipelining`` peer ``pipeline_native``, ``data`` (loaders) with its peers
``data_peers`` (the per-sample path before, torchvision's ImageFolder + PIL).

May import: the shared layer, and ``raytrain_mp.ddp`` and ``raytrain_mp.pipeline``, which it
measures (their training step, SyncBatchNorm, evaluation helpers and ``PipelineTrainer``).
Nothing outside ``bench`` imports it but the command line.
"""
