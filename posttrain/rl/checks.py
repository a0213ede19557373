"""The rlvr stage's start-up checks that need live objects — the registries its modules fill, the
processes of the run — beyond what its config sections check themselves (`config.rl`)."""

from __future__ import annotations

from posttrain.config import RunConfig
from posttrain.config.registry import check_registered
from posttrain.errors import UserError


def check_episode_cohorts(cfg: RunConfig) -> None:
    """`rl.episode_cohorts` other than 1 needs multi-turn episodes: the rlvr stage with rl.env other
    than 'single', or the eval stage with a multi-turn suite such as repo_fix."""
    if cfg.rl.episode_cohorts == 1:
        return
    if "rlvr" in cfg.stages and cfg.rl.env != "single":
        return
    from posttrain.rl.tasks.suites import multi_turn_suites

    if "rlvr" in cfg.stages or "eval" not in cfg.stages or not multi_turn_suites(cfg.eval.suites):
        raise UserError(
            f"rl.episode_cohorts={cfg.rl.episode_cohorts} cannot take effect: only multi-turn episodes "
            "(stage rlvr with rl.env='tool', or stage eval with a multi-turn suite such as repo_fix) "
            f"run in cohorts, and this run ({', '.join(cfg.stages)}) has none",
            key="rl.episode_cohorts",
        )


def register_builtins() -> None:
    """Import the modules whose built-in policy losses, estimators, environments, domains and
    verifiers register themselves."""
    import posttrain.rl.algo.advantages  # noqa: F401
    import posttrain.rl.algo.kl  # noqa: F401
    import posttrain.rl.algo.losses  # noqa: F401
    import posttrain.rl.tasks.registry  # noqa: F401


def check_rlvr_stage(cfg: RunConfig) -> None:
    """The rlvr stage's start-up checks: the names its keys give are registered (policy losses,
    advantage and KL estimators, environments, domains, curriculum bands), user verifiers exist
    where their timeout is set, and what the run's processes, images and placement cannot do."""
    from posttrain.rl.envs.images import check_rl_images
    from posttrain.rl.rollout.hosts import check_multihost_rl
    from posttrain.rl.rollout.inflight import check_inflight
    from posttrain.rl.rollout.remote import check_disaggregated
    from posttrain.rl.tasks.registry import USER_VERIFIERS, curriculum_options
    from posttrain.rl.tasks.rg_domain import check_rg

    register_builtins()
    r = cfg.rl
    check_registered(r)  # an unknown name first: the stage's rules judge the keys by the names given
    cfg.check_stages()
    curriculum_options(r.curriculum)  # band names
    check_rg(cfg)  # reasoning-gym domains: the package, datasets, settings, curriculum levels
    if r.verifier_timeout_s != 30.0 and not (r.verifiers or USER_VERIFIERS.names()):
        raise UserError(
            f"rl.verifier_timeout_s={r.verifier_timeout_s!r} cannot take effect: only user verifiers (rl.verifiers) "
            "have this timeout; the math and code verifiers have their own",
            key="rl.verifier_timeout_s",
        )
    check_rl_images(cfg)
    check_multihost_rl(cfg)
    check_inflight(cfg)
    if r.placement == "disaggregated":
        check_disaggregated(cfg)
