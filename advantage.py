"""Everything that turns a batch into agent j's weighted advantages and the step's estimate (paper, Section 5).

Group-relative advantages (Eq. (2)), GAE(lambda) with a value head, the sequence-aware truncated importance
weights w = prod min(1, rho_t) of the agents promoted earlier in the stage, the counterfactual baseline's
signal R - b_j, the truncation bias zeta, and the surrogate L_i estimated at the step kept
(``build_inputs`` for Algorithm 1's lines 6-7, ``step_estimates`` after line 11).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

from logprobs import LOG_RATIO_CAP, masked_mean, masked_sum, response_hidden_states
from rollout import TeamBatch, Turn
from sat_config import SatConfig
from team import Agent


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, clip: float | None = 5.0,
                     weights: torch.Tensor | None = None, normalize: bool = True) -> torch.Tensor:
    """Group-relative advantages (R - mean_g) / (std_g + eps), clipped to +-clip (paper, Section 5, Eq. (2)).

    A group is the G joint trajectories of one prompt (``group_ids`` [N], any labels), compared with each
    other, so no value model is needed. ``normalize=False``: R - mean_g in reward units (the certificate's
    A). std is the *population* std (defined for groups of one, weighted form sum w (R - m)^2 / sum w; the
    sample std only rescales a group by sqrt(G / (G - 1))). An all-equal group gets 0, also with eps = 0.
    ``weights`` [N] >= 0 (e.g. the truncated importance weights w(tau)) weight the group mean and std; a
    weightless group gets 0. [N] rewards -> [N] advantages."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [N], got {tuple(rewards.shape)}, "
                         f"{tuple(group_ids.shape)}")
    r = rewards.to(torch.float64) if not rewards.is_floating_point() else rewards  # [N]
    w = torch.ones_like(r) if weights is None else weights.to(r.dtype)  # [N]
    if w.shape != r.shape:
        raise ValueError(f"weights must be [N], got {tuple(w.shape)}")
    if (w < 0).any():
        raise ValueError("weights must be non-negative")
    _, inv = torch.unique(group_ids, return_inverse=True)  # [N] group index in 0..G-1
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    w_sum = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inv, w)  # [G]
    safe = w_sum.clamp_min(torch.finfo(r.dtype).tiny)  # [G]
    mean = torch.zeros_like(w_sum).index_add_(0, inv, w * r) / safe  # [G]
    centred = r - mean[inv]  # [N]
    var = torch.zeros_like(w_sum).index_add_(0, inv, w * centred.pow(2)) / safe  # [G]
    scale = var.sqrt()[inv] + eps  # [N]
    # eps = 0 on an all-equal group would be 0 / 0: such a group carries no signal.
    adv = torch.where(scale > 0, centred / scale.clamp_min(torch.finfo(r.dtype).tiny), torch.zeros_like(r))  # [N]
    if not normalize:
        adv = centred  # [N] reward units
    adv = torch.where(w_sum[inv] > 0, adv, torch.zeros_like(adv))  # [N] weightless group: no signal
    if clip is not None:
        adv = adv.clamp(-clip, clip)  # [N]
    return adv


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95,
        traces: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE(lambda) with truncated traces over right-padded sequences.

        delta_t = r_t + gamma * V_{t+1} - V_t               (V_{t+1} = 0 after the last valid token)
        A_t     = delta_t + gamma * lam * c_{t+1} * A_{t+1}
                = sum_k (gamma lam)^k (c_{t+1} ... c_{t+k}) delta_{t+k}

    With c = 1 this is GAE(lambda) (Schulman et al., 2016); with c_t = min(1, rho_t) the Retrace-style
    truncation (Munos et al., 2016): the tail starts with a_{t+1}, drawn by the behaviour policy, so
    its ratio decides how much of the tail to trust; capping at 1 keeps the trace product bounded.
    The current token's own ratio enters the loss through the PPO ratio instead.
    rewards, values, mask, traces (None: all ones): [B, T], each row valid on a prefix (a position
    whose successor is invalid is terminal) -> (advantages [B, T], returns = advantages + values),
    both 0 on padding."""
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(f"rewards, values, mask must all be [B, T], got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    if traces is not None and traces.shape != rewards.shape:
        raise ValueError(f"traces must be [B, T], got {tuple(traces.shape)}")
    valid = mask.bool()  # [B, T]
    zero = torch.zeros_like(values)  # [B, T]
    r = torch.where(valid, rewards.to(values.dtype), zero)  # [B, T] padding never leaks in
    v = torch.where(valid, values, zero)  # [B, T]
    c = zero + 1 if traces is None else torch.where(valid, traces.to(values.dtype), zero)  # [B, T]
    _, T = r.shape
    adv = torch.zeros_like(v)  # [B, T]
    next_adv = torch.zeros_like(v[:, 0])  # [B]   A_{t+1}, 0 past the end
    next_value = torch.zeros_like(v[:, 0])  # [B] V_{t+1}, 0 past the end (bootstrap 0)
    next_trace = torch.zeros_like(v[:, 0])  # [B] c_{t+1} * valid_{t+1}
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [B]
        a_t = delta + gamma * lam * next_trace * next_adv  # [B]
        a_t = torch.where(valid[:, t], a_t, torch.zeros_like(a_t))  # [B]
        adv[:, t] = a_t
        # The successor of t - 1 is t: invalid positions carry no value and cut the trace.
        next_adv = a_t  # [B]
        next_value = v[:, t]  # [B] already 0 on padding
        next_trace = torch.where(valid[:, t], c[:, t], torch.zeros_like(a_t))  # [B]
    returns = torch.where(valid, adv + v, zero)  # [B, T]
    return adv, returns


def _summed_log_ratios(log_ratios: Sequence[tuple[torch.Tensor, torch.Tensor]], batch_size: int | None,
                       truncate: bool) -> torch.Tensor:
    """sum over agents and tokens of log rho_t (min(0, log rho_t) with ``truncate``) -> [B]."""
    if len(log_ratios) == 0 and batch_size is None:
        raise ValueError("no earlier agents: pass batch_size to get the all-zero log weights")
    for log_rho, mask in log_ratios:
        if log_rho.dim() != 2 or mask.shape != log_rho.shape:
            raise ValueError(f"each entry must be ([B, T] log rho, [B, T] mask), got {tuple(log_rho.shape)}, "
                             f"{tuple(mask.shape)}")
    if len(log_ratios) == 0:
        return torch.zeros(batch_size, dtype=torch.float32)  # [B]
    total = 0
    for log_rho, mask in log_ratios:
        total = total + masked_sum(log_rho.clamp_max(0.0) if truncate else log_rho, mask, dim=1)  # [B]
    return total


def truncated_log_weights(log_ratios: Sequence[tuple[torch.Tensor, torch.Tensor]],
                          batch_size: int | None = None) -> torch.Tensor:
    """log w(tau) = log prod_t min(1, rho_t) over the tokens of the already-updated agents (paper, Section 5).

    For step i of a stage ``log_ratios`` holds, per agent sigma(1..i-1), its per-token
    log rho_t = log pi_tar(a_t|s_t) - log pi_cur(a_t|s_t) [B, T_k] and the mask of its tokens [B, T_k].
    log min(1, rho) = min(0, log rho): a sum in log space that never overflows, w <= 1.
    ``batch_size`` is needed only for an empty list (the first agent: w = 1). -> [B] log weights <= 0."""
    return _summed_log_ratios(log_ratios, batch_size, truncate=True)


def full_log_weights(log_ratios: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     batch_size: int | None = None) -> torch.Tensor:
    """log W(tau) = log prod_t rho_t over the already-updated agents' tokens (no truncation), inputs as
    ``truncated_log_weights``. W makes rollouts of pi_cur unbiased for pi_hat_{i-1}; it only estimates
    what the truncation to w costs (``truncation_bias``), never a training weight (its variance
    explodes with length)."""
    return _summed_log_ratios(log_ratios, batch_size, truncate=False)


LOG_WEIGHT_CAP = math.log(1e6)  # the cap on log W and log w before exp in ``truncation_bias``


def truncation_bias(log_w_full: torch.Tensor, log_w_trunc: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor,
                    log_cap: float = LOG_WEIGHT_CAP) -> float:
    """zeta estimate: | mean((W - w) * ratio * A) |  (the zeta_i of Theorem 4.2), four [B] tensors.

    The importance-sampled surrogate of step i is mean(W * ratio * A) with the exact W = prod rho_t; SAT
    trains with the truncated w = prod min(1, rho_t). Their difference is the bias truncation brings into
    the surrogate estimate (the advantages' own error is taken as given); a sample mean, so an estimate.

    Both logs are capped at ``log_cap`` (log 1e6) before exp: W can overflow, and an inf would make the
    certificate meaningless. The cap is NOT conservative: where it binds, zeta can come out smaller.
    ``sat.trust_region_step`` logs how many rows hit it (``zeta_capped_rows``); a non-zero count means the
    weights have collapsed and zeta should not be trusted (``--reuse regenerate``: zeta is exactly 0)."""
    if not (log_w_full.shape == log_w_trunc.shape == ratio.shape == adv.shape) or log_w_full.dim() != 1:
        raise ValueError("truncation_bias expects four [B] tensors of equal shape")
    if log_w_full.numel() == 0:
        return 0.0
    big_w = log_w_full.double().clamp_max(log_cap).exp()  # [B]
    small_w = log_w_trunc.double().clamp_max(log_cap).exp()  # [B]
    return abs(((big_w - small_w) * ratio.double() * adv.double()).mean().item())


def credit_correlation(adv: torch.Tensor, correct: torch.Tensor) -> float | None:
    """Pearson correlation between an agent's advantages and its own correctness over the batch (None
    when either is constant): how much of the team credit an agent receives tracks whether it was right."""
    a = (adv if adv.dim() == 1 else adv.mean(1)).double()  # [N]
    c = correct.double()  # [N]
    a, c = a - a.mean(), c - c.mean()
    denom = float((a.square().sum() * c.square().sum()).sqrt())
    return float((a * c).sum()) / denom if denom > 0 else None


# -- Agent j's weighted advantages from the batch (Algorithm 1, lines 6-7) and the step's estimate -----------------
@dataclass
class UpdateInputs:
    """What agent j's update needs from the batch."""

    turn: Turn
    adv: torch.Tensor  # [N] or [N, L] advantages (normalised, clipped)
    raw_adv: torch.Tensor  # [N] R - group mean, in reward units, for the certificate
    log_w: torch.Tensor  # [N] truncated log weights from earlier agents (0 for the first)
    log_w_full: torch.Tensor  # [N] untruncated, for zeta
    returns: torch.Tensor | None = None  # [N, L] value targets (gae)


def build_inputs(batch: TeamBatch, j: int, cached_log_ratios: list[tuple[torch.Tensor, torch.Tensor]],
                 cfg: SatConfig, model=None, value_head=None) -> UpdateInputs:
    """Sequence-aware weights and advantages for the agent updated at this step.

    w(tau) = prod over the tokens of agents already updated this stage of
    min(1, rho_t), from their cached log-ratios (empty for the first agent, with
    --reuse regenerate, and with --update joint). Group advantages use w as
    weights, so the baseline is an estimate under pi_hat^{i-1}, not under the
    stale pi_cur. With --adv gae the advantages are ``gae_advantages``' instead:
    w is not in them, it weights the row's surrogate only (see there)."""
    n = len(batch)
    log_w = truncated_log_weights(cached_log_ratios, batch_size=n).float()  # [N]
    log_w_full = full_log_weights(cached_log_ratios, batch_size=n).float()  # [N]
    weights = log_w.exp()  # [N]
    if cfg.baseline == "counterfactual" and batch.counterfactual is not None:
        # R - b_j: the others' answers held fixed (reward.counterfactual_baselines), then Eq. (2)'s normalisation
        signal = batch.rewards - batch.counterfactual[j]  # [N], in [-(R_max - R_min), R_max - R_min]
        adv = group_advantages(signal, batch.group_ids, clip=cfg.adv_clip, weights=weights).float()  # [N]
        raw_adv = signal.float()  # [N] reward units, for the certificate
    else:
        adv = group_advantages(batch.rewards, batch.group_ids, clip=cfg.adv_clip, weights=weights).float()  # [N]
        raw_adv = group_advantages(batch.rewards, batch.group_ids, clip=None, weights=weights,
                                   normalize=False).float()  # [N]
    turn, returns = batch.turns[j], None
    if cfg.adv == "gae":
        adv, returns = gae_advantages(turn, batch.rewards, model, value_head, cfg)  # [N, Lr] x2
    return UpdateInputs(turn, adv, raw_adv, log_w, log_w_full, returns)


@torch.no_grad()
def gae_advantages(turn: Turn, rewards: torch.Tensor, model, value_head,
                   cfg: SatConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE(lambda) advantages (gamma = 1, whitened over agent j's tokens, clipped like the group
    advantages) and value targets: ``gae`` over the agent's own tokens, the team reward on its last one, V from
    ``value_head`` on the agent's current hidden states. -> ([N, Lr], [N, Lr]).

    What this estimates, exactly: no traces are passed to ``gae`` (c = 1 at every token). Agent j's own tokens
    have rho = 1 under pi_hat^{i-1} (j is not yet updated), so c = 1 is exact on them; the drift of the agents
    promoted before j (their tokens precede, follow or lie between j's, and the reward depends on them) is not
    corrected token by token. It enters only as the row weight w = prod min(1, rho) that multiplies the row's
    clipped surrogate in ``update.negative_objective``; the whitening here is unweighted. The returns
    (advantages + V) are lambda-returns of the rollouts of pi_cur and the value loss regresses on them unweighted
    (``update._micro_batch_loss``), so V estimates agent j's values under the behaviour team pi_cur, not under
    pi_hat^{i-1}."""
    values = torch.zeros_like(turn.behaviour_logprobs)  # [N, Lr]
    for s in range(0, len(rewards), cfg.minibatch_size):
        sl = slice(s, s + cfg.minibatch_size)
        rows = turn.tensors.rows(sl, value_head.weight.device)  # [b, Lc] and [b, Lr] tensors
        hidden = response_hidden_states(model, *rows)  # [b, Lr, H]
        values[sl] = value_head(hidden.float()).squeeze(-1).cpu() * turn.response_mask[sl]
    order = own_tokens_first(turn.response_mask)  # [N, Lr]: GAE runs over the agent's own timesteps only
    mask = turn.response_mask.gather(1, order).float()  # [N, Lr] a prefix of each row
    last = (mask.sum(1) - 1).clamp_min(0).long()  # [N] index of the final token
    token_rewards = torch.zeros_like(mask).scatter_(1, last[:, None], rewards[:, None].float()) * mask  # [N, Lr]
    tok_adv, returns = gae(token_rewards, values.gather(1, order), mask, gamma=1.0, lam=cfg.gae_lambda)  # [N, Lr] x2
    tok_adv, returns = unpack(tok_adv, order), unpack(returns, order)  # [N, Lr] x2 at the tokens' own positions
    mask = turn.response_mask.float()  # [N, Lr]
    mean = masked_mean(tok_adv, mask)
    std = masked_mean((tok_adv - mean) ** 2, mask).sqrt()
    adv = ((tok_adv - mean) / (std + 1e-6)).clamp(-cfg.adv_clip, cfg.adv_clip) * mask  # [N, Lr]
    return adv.float(), returns


def own_tokens_first(mask: torch.Tensor) -> torch.Tensor:
    """[N, L] a permutation of each row's positions: the agent's own tokens (mask 1) first, in order, then the
    rest. In an episode the environment's and the other agents' tokens sit between the agent's turns; its own
    timesteps are consecutive in this order, so GAE bootstraps from its next own token. Without rounds the own
    tokens are already a prefix and the order is the identity."""
    return torch.sort((mask == 0).to(torch.int8), dim=1, stable=True).indices  # [N, L]


def unpack(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[N, L] values in ``order``'s positions put back where they came from (the inverse of ``gather``)."""
    return torch.zeros_like(x).scatter_(1, order, x)  # [N, L]


def make_value_head(agent: Agent) -> torch.nn.Linear:
    """Agent's GAE value head, hidden state -> V: weight 0 and bias 0.5 (a neutral prior for a {0, 1} reward).

    Built on the meta device and filled explicitly, so that it draws nothing from torch's global RNG: a resumed
    run builds its heads after the checkpoint restored that RNG, and a draw here would shift every later one.
    Returned frozen, the state a head is in between its agent's updates in a straight run: the forward in
    ``gae_advantages`` rounds differently (in the last bits) when the weight requires grad, so a resumed run whose
    heads were not frozen would leave the straight run's path."""
    hidden = agent.model.config.hidden_size
    head = torch.nn.Linear(hidden, 1, device="meta", dtype=torch.float32).to_empty(device=agent.device)
    with torch.no_grad():
        head.weight.zero_()  # [1, H]
        head.bias.fill_(0.5)  # [1]
    return head.requires_grad_(False)  # frozen between its agent's updates (update._start_training thaws it)


ESS_WARN_RATIO = 0.1  # warn when an agent's ESS of the weights falls below this fraction of N


def step_estimates(inputs: UpdateInputs, log_rho: torch.Tensor, kl: torch.Tensor, batch: TeamBatch, j: int) -> dict:
    """The paper's surrogate L_i (Section 3) in its practical form, Eq. (5) of Section 5, at the step kept and
    in reward units: an ESTIMATE of the step's change. Agent j acts once per joint trajectory and the states
    at its turn come from agents the step does not change, so J(pi_hat^i) - J(pi_hat^{i-1}) =
    E_{pi_hat^{i-1}}[(r_j - 1)(R - b)] exactly, for any baseline b of the problem; the sample mean of
    w (r_j - 1) A estimates it. It is not a bound: the rows are those the step was trained on, and r_j, a
    whole response's ratio, is heavy-tailed at real response lengths (``surrogate_ess``: the effective sample
    size of w r_j). Also the truncation bias zeta of the weights and their effective sample size."""
    mask = inputs.turn.response_mask  # [N, Lr]
    log_r_seq = masked_sum(log_rho, mask, dim=1).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)  # [N] log r_j of the step kept
    w = inputs.log_w.exp()  # [N] truncated weights of the agents promoted before j
    surrogate = float((w * (log_r_seq.exp() - 1) * inputs.raw_adv).mean())  # E_new[A] - E_cur[A]
    zeta = truncation_bias(inputs.log_w_full, inputs.log_w, log_r_seq.exp(), inputs.raw_adv)
    # the response is the agent's action: its KL is the sum of its tokens' per-state KLs
    seq_kl = torch.zeros(mask.shape).masked_scatter_(mask.bool(), kl).sum(1)  # [N]
    n, wr = len(batch), w * log_r_seq.exp()  # wr: [N] the estimate's importance weights
    ess = float(w.sum() ** 2 / (w ** 2).sum())
    if ess < ESS_WARN_RATIO * n:
        warnings.warn(f"the effective sample size of the sequence-aware weights fell below {ESS_WARN_RATIO:.0%} of N: "
                      "later agents get little gradient; consider --reuse regenerate", stacklevel=2)
    return {"surrogate_estimate": surrogate, "surrogate_ess": float(wr.sum() ** 2 / (wr ** 2).sum()), "zeta": zeta,
            "zeta_capped_rows": int((inputs.log_w_full > LOG_WEIGHT_CAP).sum()), "N": n, "ess": ess,
            "ess_ratio": ess / n, "seq_kl_max": float(seq_kl.max()),
            "credit_correlation": credit_correlation(inputs.adv, batch.agent_reward[j])}
