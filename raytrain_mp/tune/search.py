"""The Ray Tune objects a sweep's options make: its search space, its search algorithm, its scheduler.

Job: ``TuneConfig`` (pure, ``tune.config``) says *what* is searched; this module says it in Tune's
terms. Invariants:

- Every dimension is keyed by its ``DDPConfig`` field, so each trial's point is a ``DDPConfig``
  replacement whatever chooses it (``trainable.run_trial``).
- ``grid``: every combination (``tune.grid_search``), the lrs drawn by ``TuneConfig`` itself when
  given a range. ``random`` and ``optuna``: ``--num-samples`` points, each varying grid a
  ``tune.choice`` and an lr range ``tune.loguniform``; both seeded by ``--seed`` (Tune's random
  generator, Optuna's TPE sampler), so a rerun proposes the same first points. With ``pbt``,
  Optuna proposes the starting population (``search_alg``).
- ``pbt`` resamples only ``tune.config.PERTURBED`` (lr, weight decay) from the same distributions,
  and exploits through the trials' Tune checkpoints (``trainable.start_of``); ``asha`` and ``pbt``
  count epochs (``time_attr="epoch"``), not Tune iterations, which restart with a resumed trial.
"""

from __future__ import annotations

import warnings
from typing import Any

from ray import tune
from ray.tune.schedulers import ASHAScheduler, PopulationBasedTraining
from ray.tune.search import BasicVariantGenerator, Searcher


def param_space(cfg: Any) -> dict[str, Any]:
    """The search space of ``cfg`` (a validated ``TuneConfig``) for ``tune.Tuner``."""
    if cfg.search == "grid":
        return {name: tune.grid_search(list(values)) for name, values in cfg.grid().items()}
    varying = distributions(cfg)
    return {name: varying.get(name, values[0]) for name, values in cfg.grid().items()}


def distributions(cfg: Any) -> dict[str, Any]:
    """Each varying dimension's distribution: the lr range log-uniform, a grid a uniform choice."""
    space = {name: tune.choice(list(values)) for name, values in cfg.varying().items()}
    if cfg.log_uniform:
        space["base_lr"] = tune.loguniform(cfg.lr_min, cfg.lr_max)
    return space


def search_alg(cfg: Any, max_concurrent: int) -> Searcher | BasicVariantGenerator | None:
    """Tune's search algorithm for ``cfg.search`` (None: Tune's default, which expands the grid).
    ``max_concurrent`` is passed to a ``BasicVariantGenerator`` itself: Tune applies its
    ``max_concurrent_trials`` to its own default generator and to a ``Searcher`` only.

    Tune's PBT takes no search algorithm (it resamples points itself and refuses one), so with
    ``pbt`` Optuna proposes the starting population instead: its quasi-random (Sobol) sampler
    spreads the points over the space more evenly than independent draws."""
    if cfg.search == "random":
        return BasicVariantGenerator(random_state=cfg.seed, max_concurrent=max_concurrent)
    if cfg.search == "optuna" and cfg.scheduler == "pbt":
        population = optuna_population(cfg)
        return BasicVariantGenerator(
            points_to_evaluate=population, random_state=cfg.seed, max_concurrent=max_concurrent
        )
    if cfg.search == "optuna":
        from optuna.samplers import TPESampler
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(sampler=TPESampler(seed=cfg.seed))
    return None


def optuna_population(cfg: Any) -> list[dict[str, Any]]:
    """``cfg.num_trials()`` points of the varying dimensions, asked of a seeded Optuna QMC study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():  # "QMCSampler is experimental": its interface, not its draws
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(sampler=optuna.samplers.QMCSampler(seed=cfg.seed))
    grids = {name: values for name, values in cfg.varying().items() if not (name == "base_lr" and cfg.log_uniform)}
    points = []
    for _ in range(cfg.num_trials()):
        trial = study.ask()
        point = {name: trial.suggest_categorical(name, list(values)) for name, values in grids.items()}
        if cfg.log_uniform:
            point["base_lr"] = trial.suggest_float("base_lr", cfg.lr_min, cfg.lr_max, log=True)
        points.append(point)
    return points


def scheduler(cfg: Any) -> ASHAScheduler | PopulationBasedTraining | None:
    """Tune's trial scheduler for ``cfg.scheduler``."""
    if cfg.scheduler == "asha":
        return ASHAScheduler(
            time_attr="epoch", max_t=cfg.epochs, grace_period=cfg.grace_period, reduction_factor=cfg.reduction_factor
        )
    if cfg.scheduler == "pbt":
        space = distributions(cfg)
        return PopulationBasedTraining(
            time_attr="epoch",
            perturbation_interval=cfg.perturbation_interval,
            hyperparam_mutations={name: space[name] for name in cfg.perturbed()},
        )
    return None
