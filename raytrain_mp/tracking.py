"""MLflow tracking of runs (``--mlflow``, ``--mlflow-experiment``; the options:
``tracking_options``): the MLflow run of a training run, sweep or trial, and the writer of its metrics.

Job: on the driver of a run (the command, a Tune trial's function) ``open_run`` finds or starts
its MLflow run and logs the params and tags, ``close_run`` logs the artifacts and the end status
(``tracked`` does both around a command's run); ``Tracker`` logs the rows of
``run_log.RunLog`` (``metrics.csv``) as MLflow metrics by global step, from the log's one writer.

Invariants:
- One writer of metrics a run, as for ``run_log``: rank 0 of a DDP run (a Tune trial is one), the
  driver of a pipeline run. Rows reach MLflow when ``RunLog`` publishes them (before every
  checkpoint and at every epoch end). MLflow's names: a step row's columns as they are
  (``train_loss``, ``lr``, ...), an epoch row's ``val_*`` as they are and its other columns
  ``epoch_*``.
- One MLflow run a run folder, found by its tag ``raytrain_mp.key`` (the folder's URI): a resumed
  run continues it (a rerun of the name with a checkpoint to resume; ``--max-failures`` restarts
  and elastic resizes, where the driver keeps it anyway), a run started afresh (no checkpoint)
  starts a new one. A sweep is a parent run (its experiment folder; ``--resume`` continues it)
  with a child for each Train run of its trials (``raytrain_mp.trial``): one a trial, and one
  more for each PBT exploit, whose new Train run continues another trial's checkpoint from its
  step on (``raytrain_mp.resumed_from``), while the run it replaced keeps the steps it trained.
- No step twice: an attempt logs a metric's rows only after the last step MLflow holds for it,
  which it asks once, when it first logs the metric (a crashed attempt may have logged past the checkpoint
  its successor resumes from; those steps are trained again the same way and not logged again).
- Params are the run's options as its ``config.yaml`` holds them (``config.to_yaml``), each the
  ``str`` of its YAML value. MLflow params cannot change: a run continued under other options keeps
  the ones it started with (its checkpoints' ``config.yaml`` have the new ones).
- Tracking never ends a run: the first failure (no server, a refused request, MLflow missing on a
  worker) is one warning line and the run goes on without MLflow, logging locally as always.
  MLflow's HTTP client is made to give up in seconds (``HTTP_DEFAULTS``, unless the environment
  sets them), not after its default minutes of retries.

Why MLflow's client and not Ray's ``ray.air.integrations.mlflow``: ``setup_mlflow`` starts a new
MLflow run on every call, with no way to continue one across Ray Train's restarts or a rerun, and
``MLflowLoggerCallback`` is a Tune logger callback, which Ray Train V2 runs do not take. MLflow's
own client (``MlflowClient``, explicit run ids, no global active run) does the logging.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from raytrain_mp.config import to_yaml
from raytrain_mp.interruption import Interrupted
from raytrain_mp.storage import Location, locate, name_of

KEY_TAG = "raytrain_mp.key"
# MLflow's HTTP client retries a refused request 7 times with doubling waits (minutes) by default.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}  # fmt: skip
# MLflow's limits on one log_batch request.
BATCH_METRICS, BATCH_PARAMS = 1000, 100


def warning(line: str) -> None:
    print(f"raytrain-mp: warning: {line}", file=sys.stderr, flush=True)


def _failed(uri: str, exc: BaseException) -> str:
    cause = " ".join(str(exc).split())[:200] or type(exc).__name__
    return f"MLflow at {uri}: {cause}; the run goes on without it (metrics.csv and TensorBoard as always)"


def client(uri: str | None = None) -> Any:
    """MLflow's client of ``uri`` (default: MLflow's tracking URI), giving up in seconds (``HTTP_DEFAULTS``)."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def params_of(config: Any) -> dict[str, str]:
    """A run's MLflow params: its options as ``config.yaml`` holds them, each the ``str`` of its YAML value."""
    return {name: str(value) for name, value in yaml.safe_load(to_yaml(config)).items()}


def open_run(
    config: Any,
    key: str,
    name: str,
    resumes: bool,
    tags: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
) -> Any:
    """``config`` with the MLflow run its run logs to (``mlflow_tracking_uri``, ``mlflow_run_id``):
    with ``resumes``, the newest one tagged ``key`` continued, else a new one named ``name``
    (a child of ``config.mlflow_parent_run_id`` when set), given the ``params`` it lacks (default:
    ``params_of(config)``). Without ``--mlflow``, ``config`` as it is; on any MLflow failure, one
    warning line and ``config`` as it is."""
    if not config.mlflow:
        return config
    uri = os.environ.get("MLFLOW_TRACKING_URI", "MLflow's default tracking URI")
    try:
        uri = tracking_uri(config)
        mlflow_client = client(uri)
        experiment = experiment_id(mlflow_client, config.mlflow_experiment)
        found = newest_run(mlflow_client, experiment, key) if resumes else None
        params = params_of(config) if params is None else params
        if found is not None:
            run_id = found.info.run_id
            mlflow_client.update_run(run_id, status="RUNNING")
            params = {k: v for k, v in params.items() if k not in found.data.params}
        else:
            parent = {"mlflow.parentRunId": config.mlflow_parent_run_id} if config.mlflow_parent_run_id else {}
            run_id = mlflow_client.create_run(
                experiment, run_name=name, tags={KEY_TAG: key, **parent, **(tags or {})}
            ).info.run_id
        log_params(mlflow_client, run_id, params)
    except Exception as exc:  # noqa: BLE001  # tracking never ends a run
        warning(_failed(uri, exc))
        return config
    return dataclasses.replace(config, mlflow_tracking_uri=uri, mlflow_run_id=run_id)


def tracking_uri(config: Any) -> str:
    """Where ``config``'s run is tracked: the driver's choice, else MLflow's (``MLFLOW_TRACKING_URI``
    or its default), made absolute."""
    import mlflow

    return config.mlflow_tracking_uri or absolute_uri(mlflow.get_tracking_uri())


def newest_run(mlflow_client: Any, experiment: str, key: str) -> Any:
    """The newest MLflow run of ``experiment`` tagged ``key``, None when there is none."""
    newest_first = ["attributes.start_time DESC"]
    found = mlflow_client.search_runs(
        [experiment], filter_string=f"tags.`{KEY_TAG}` = '{key}'", order_by=newest_first, max_results=1
    )
    return found[0] if found else None


def absolute_uri(uri: str) -> str:
    """A tracking URI with its local path made absolute (MLflow's default ``sqlite:///mlflow.db`` is
    relative to the working folder, which Ray's workers and Tune's trials do not share)."""

    def absolute(path: str) -> str:
        return str(Path(path).expanduser().resolve())

    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + absolute(uri[len("sqlite:///") :])
    if uri.startswith("file:") and not uri.startswith("file://"):
        return "file://" + absolute(uri[len("file:") :])
    return absolute(uri) if ":" not in uri and not uri.startswith("databricks") else uri


def experiment_id(mlflow_client: Any, name: str | None) -> str:
    """The id of the experiment ``name``, created when missing (None: ``MLFLOW_EXPERIMENT_NAME``, else
    MLflow's Default)."""
    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return "0"  # MLflow's Default experiment
    experiment = mlflow_client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment is not None else mlflow_client.create_experiment(name)


def log_params(mlflow_client: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), BATCH_PARAMS):
        mlflow_client.log_batch(run_id, params=items[start : start + BATCH_PARAMS])


def close_run(config: Any, status: str | None, artifacts: dict[str, bytes], tags: dict[str, str] | None = None) -> None:
    """Log ``artifacts`` (artifact path: bytes), set ``tags`` and end the MLflow run of ``config``
    (``status``: FINISHED, FAILED or KILLED; None: as it is); nothing without one; a failure is a warning line."""
    if config.mlflow_run_id is None:
        return
    try:
        mlflow_client = client(config.mlflow_tracking_uri)
        log_artifacts(mlflow_client, config.mlflow_run_id, artifacts)
        for name, value in (tags or {}).items():
            mlflow_client.set_tag(config.mlflow_run_id, name, value)
        if status is not None:
            mlflow_client.set_terminated(config.mlflow_run_id, status)
    except Exception as exc:  # noqa: BLE001  # tracking never ends a run
        warning(_failed(config.mlflow_tracking_uri, exc))


def log_artifacts(mlflow_client: Any, run_id: str, artifacts: dict[str, bytes]) -> None:
    """Each ``path: bytes`` of ``artifacts`` as the run's artifact at that path."""
    with tempfile.TemporaryDirectory(prefix="raytrain-mlflow-") as scratch:
        for path, data in artifacts.items():
            folder, _, file = path.rpartition("/")
            local = Path(scratch) / (folder or ".") / file
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
            mlflow_client.log_artifact(run_id, str(local), folder or None)


# What a run's MLflow run gets of its folder when the command ends (run_log's files).
RUN_FILES = ("curves.png", "metrics.csv")


@dataclasses.dataclass
class TrackedRun:
    """A run's config with its MLflow run (``config``), and the checkpoint it ended with, if any."""

    config: Any
    checkpoint: str | None = None


@contextmanager
def tracked(
    config: Any,
    run: Location,
    command: str,
    resumes: bool,
    files: Sequence[str] = RUN_FILES,
    tags: dict[str, str] | None = None,
) -> Iterator[TrackedRun]:
    """The MLflow run of the run folder ``run`` while the command trains it (``open_run``, keyed by
    the folder; ``resumes``: the run continues a checkpoint of its own; ``tags`` for a new one); at
    the end, however it ends, the folder's ``files``, the ``config.yaml`` of its last checkpoint (or
    its config's), the tags of its folder and checkpoint, and its end status. Without ``--mlflow``: nothing."""
    tags = {"raytrain_mp.run": run.uri, "raytrain_mp.command": command, **(tags or {})}
    run_state = TrackedRun(open_run(config, run.uri, name_of(run.uri), resumes, tags))
    try:
        yield run_state
    except BaseException as exc:
        _finish(run_state, run, files, run_status(exc))
        raise
    _finish(run_state, run, files, "FINISHED")


def _finish(run_state: TrackedRun, run: Location, files: Sequence[str], status: str) -> None:
    config = run_state.config
    if config.mlflow_run_id is None:
        return
    try:
        artifacts = {name: run.child(name).read_bytes() for name in files if run.child(name).is_file()}
        saved = run_state.checkpoint and locate(run_state.checkpoint, "checkpoint").child("config.yaml")
        artifacts["config.yaml"] = saved.read_bytes() if saved and saved.is_file() else to_yaml(config).encode()
    except Exception as exc:  # noqa: BLE001  # tracking never ends a run
        warning(_failed(config.mlflow_tracking_uri, exc))
        artifacts = {}
    tags = {"raytrain_mp.run": run.uri}
    if run_state.checkpoint:
        tags["raytrain_mp.checkpoint"] = run_state.checkpoint
    close_run(config, status, artifacts, tags)


def end_children(config: Any, status: str = "KILLED") -> None:
    """End the child runs of ``config``'s MLflow run still running: Tune stopped their trials
    (a scheduler's decision ends a trial's actor, and with it the trial's own ``close_run``)."""
    if config.mlflow_run_id is None:
        return
    try:
        mlflow_client = client(config.mlflow_tracking_uri)
        parent = mlflow_client.get_run(config.mlflow_run_id)
        children = mlflow_client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{config.mlflow_run_id}' and attributes.status = 'RUNNING'",
        )
        for child in children:
            mlflow_client.set_terminated(child.info.run_id, status)
    except Exception as exc:  # noqa: BLE001  # tracking never ends a run
        warning(_failed(config.mlflow_tracking_uri, exc))


def log_outputs(config: Any, run: str, name: str, files: Sequence[str | Path], prefix: str) -> None:
    """``files`` as artifacts under ``prefix`` of the MLflow run of the run folder ``run`` (a
    command's outputs about a run, ``eval``'s), a new MLflow run named ``name`` when it has none."""
    if not config.mlflow:
        return
    artifacts = {f"{prefix}/{Path(file).name}": Path(file).read_bytes() for file in files}
    uri = os.environ.get("MLFLOW_TRACKING_URI", "MLflow's default tracking URI")
    try:
        uri = tracking_uri(config)
        mlflow_client = client(uri)
        found = newest_run(mlflow_client, experiment_id(mlflow_client, config.mlflow_experiment), run)
    except Exception as exc:  # noqa: BLE001  # tracking never ends a command
        warning(_failed(uri, exc))
        return
    if found is not None:  # the training run's status and end time stay its own
        trained = dataclasses.replace(config, mlflow_tracking_uri=uri, mlflow_run_id=found.info.run_id)
        close_run(trained, None, artifacts)
    else:
        opened = open_run(config, run, name, resumes=False, tags={"raytrain_mp.run": run}, params={})
        close_run(opened, "FINISHED", artifacts)


def run_status(exc: BaseException) -> str:
    """MLflow's end status of a run that raised ``exc``: KILLED by a signal or Ctrl-C, else FAILED."""
    return "KILLED" if isinstance(exc, (Interrupted, KeyboardInterrupt, SystemExit)) else "FAILED"


def metric_name(kind: str, column: str) -> str:
    """The MLflow metric of a ``metrics.csv`` column in a row of ``kind`` (see the module's invariants)."""
    return column if kind == "step" or column.startswith("val_") else f"epoch_{column}"


NOT_METRICS = ("kind", "global_step", "epoch")


class Tracker:
    """Logs a run's ``metrics.csv`` rows to its MLflow run, each metric's steps once (see the
    module's invariants); ``warn`` shows the one line of its first failure, after which it logs nothing."""

    def __init__(self, uri: str, run_id: str, warn: Callable[[str], None] = warning) -> None:
        self.uri, self.run_id, self.warn = uri, run_id, warn
        self._client: Any = None
        self._through: dict[str, int] = {}  # metric: the last step MLflow holds
        self.failed = False

    @classmethod
    def of(cls, config: Any, warn: Callable[[str], None] = warning) -> Tracker | None:
        """The tracker of ``config``'s MLflow run (``open_run``), None without one."""
        return cls(config.mlflow_tracking_uri, config.mlflow_run_id, warn) if config.mlflow_run_id else None

    def log(self, rows: Sequence[dict[str, str]]) -> None:
        """Log the metrics of ``rows`` (``metrics.csv`` rows) at steps past what MLflow holds."""
        if self.failed:
            return
        try:
            from mlflow.entities import Metric

            if self._client is None:
                self._client = client(self.uri)
            now = int(time.time() * 1000)
            metrics = []
            for row in rows:
                step = int(row["global_step"])
                for column, value in row.items():
                    if column in NOT_METRICS or value in ("", None):
                        continue
                    name = metric_name(row["kind"], column)
                    if step <= self._logged_through(name):
                        continue
                    metrics.append(Metric(name, float(value), now, step))
                    self._through[name] = step
            for start in range(0, len(metrics), BATCH_METRICS):
                self._client.log_batch(self.run_id, metrics=metrics[start : start + BATCH_METRICS])
        except Exception as exc:  # noqa: BLE001  # tracking never ends a run
            self.failed = True
            self.warn(_failed(self.uri, exc))

    def _logged_through(self, name: str) -> int:
        """The last step of ``name`` MLflow holds (-1: none), asked once an attempt."""
        if name not in self._through:
            history = self._client.get_metric_history(self.run_id, name)
            self._through[name] = max((metric.step for metric in history), default=-1)
        return self._through[name]
