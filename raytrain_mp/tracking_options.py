"""The options of MLflow tracking (``--mlflow``, ``--mlflow-experiment``), shared by the ``ddp``,
``pipeline``, ``tune`` and ``eval`` configs; what they do is ``tracking``'s.

Job: the fields and their checks, as a dataclass mixin a command's config inherits. Invariants:
pure (no MLflow, torch, Ray or pyarrow import: the command line builds its parser from these);
``--mlflow`` without MLflow installed is one line before anything starts; the hidden fields are
what a driver hands its run's one metrics writer (rank 0, a trial), never saved in ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from raytrain_mp.config import check, option

INSTALL = "pip install 'raytrain_mp[mlflow]'"


@dataclasses.dataclass
class TrackingOptions:
    """Where a run's params, metrics and artifacts are tracked besides the run folder."""

    mlflow: bool = option(
        False,
        "also log the run to MLflow at MLFLOW_TRACKING_URI (else MLflow's default): options as params, "
        "metrics by global step, curves.png and config.yaml as artifacts; a resumed run continues its MLflow run",
        group="output",
    )
    mlflow_experiment: str | None = option(
        None, "--mlflow: the MLflow experiment (default: MLFLOW_EXPERIMENT_NAME, else MLflow's Default)", group="output"
    )
    # Set by the driver for the run's one metrics writer (rank 0, a trial): where its MLflow run is.
    mlflow_tracking_uri: str | None = option(None, "internal: the MLflow tracking URI", hidden=True, group="output")
    mlflow_run_id: str | None = option(None, "internal: the MLflow run this run logs to", hidden=True, group="output")
    mlflow_parent_run_id: str | None = option(
        None, "internal: a sweep's MLflow run, the parent of its trials' runs", hidden=True, group="output"
    )

    def validate(self) -> None:
        # the next base's in a training command's config (TrainOptions'); eval's has none
        getattr(super(), "validate", lambda: None)()
        check(self.mlflow or self.mlflow_experiment is None, "mlflow_experiment", "needs --mlflow")
        check(
            not self.mlflow or importlib.util.find_spec("mlflow") is not None,
            "mlflow",
            f"needs MLflow, which is not installed; accepted: {INSTALL}",
        )
