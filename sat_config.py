"""SatConfig: the settings Algorithm 1 reads, and nothing else (``harness.config.Config.core`` derives it from a
run's options). ``sat.py``, ``update.py`` and ``advantage.py`` take it; the product's options (files, models,
devices, trackers, checkpoints) stay in ``harness/``. The sampling temperature lives in one place, ``sampling``:
the rollouts draw at it and the log-probs, ratios and KL are taken at it.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollout import SamplingConfig


@dataclass(frozen=True)
class SatConfig:
    """Each field is the ``harness.config.Config`` option of the same name (its help says what it means)."""

    # a stage (sat.py: Algorithm 1, lines 2-15)
    stages: int
    batch_size: int  # joint trajectories a stage
    group_size: int  # G: trajectories per prompt
    order: str  # sigma: static, random or greedy
    update: str  # sequential (SAT) or joint (the baseline)
    reuse: str  # weights (the paper's importance weights) or regenerate
    step_bounds: bool
    eval_every: int
    eval_samples: int
    seed: int
    device: str
    # the trust region (lines 10-11; bounds.py)
    delta: float
    quantile: float
    max_backtracks: int
    delta_conf: float
    # one agent's update (update.py: Eq. (5))
    adv: str  # grpo or gae
    ratio: str
    epochs: int
    minibatch_size: int
    eps_clip: float
    kl_estimator: str
    kl_check_every: int
    gradient_checkpointing: bool
    keep_optimizer_state: bool
    # the advantages (advantage.py: Eq. (2), the counterfactual baseline, GAE)
    adv_clip: float
    baseline: str
    gae_lambda: float
    # sampling: the temperature, top_p, response length and the token budget of a generate or forward chunk
    sampling: SamplingConfig
