"""Group-relative advantages and one policy loss whose trust region is a pluggable rule.

A token's ratio is w = exp(logp - old_logp); mu = exp(old_logp) is its probability under the policy
that sampled it. The file reads in the order of the idea: the advantages; PPO's clip as PPO writes it;
the general clip operator, which gives that clip's value and gradient for any region and says which
tokens it stopped; the registry, where a rule is one entry that owns its region's bounds(mu, cfg), the
settings it reads and its defaults; the configuration, which accepts or refuses a rule's flags from
that entry; the loss and its diagnostics; the intervals a rule admits (ratio_bounds).

The mathematics of the regions (KL3's Lambert-W bounds, the GPPO grid of divergences and estimators,
why the stop-gradient form equals the min form, the two readings of GPPO's [0.5, 10]) is in
docs/loss-derivations.md; docs/adding-a-rule.md walks through adding one.

Numerics: log w is clamped to [-20, 20] before exp (e^20 ~ 5e8 is outside every bounded region),
regions are decided in float64, and groups with equal rewards get exactly zero advantage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

ADV_STDS = ("group", "batch", "none")


def group_advantages(
    rewards: Tensor | Sequence[float], group_size: int, *, std: str = "group", leave_one_out: bool = False
) -> Tensor:
    """Advantages [N] for rewards [N] laid out prompt-major (a prompt's G samples adjacent): (r - baseline) / std.
    baseline: the group's mean, or with leave_one_out its other G-1's; std + 1e-6: group, batch or none (Dr. GRPO)."""
    r = torch.as_tensor(rewards, dtype=torch.float64, device=rewards.device if isinstance(rewards, Tensor) else "cpu")
    if r.dim() != 1 or group_size < 2 or r.numel() % group_size:
        raise ValueError(f"rewards {tuple(r.shape)} must be [N] with N a multiple of group_size={group_size} >= 2")
    if std not in ADV_STDS:
        raise ValueError(f"std must be one of {', '.join(ADV_STDS)}, got {std!r}")
    groups = r.view(-1, group_size)  # [N/G, G]
    others_mean = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    baseline = others_mean if leave_one_out else groups.mean(1, keepdim=True)
    # A mean of equal floats can be off by an ulp, and that ulp over a ~0 std would be +-1: force zero.
    all_equal = groups.amax(1, keepdim=True) == groups.amin(1, keepdim=True)
    centred = torch.where(all_equal, 0.0, groups - baseline)
    scale = {"group": groups.std(1, keepdim=True) + 1e-6, "batch": r.std() + 1e-6, "none": 1.0}[std]
    return (centred / scale).flatten().float()


def advantages(rewards: Tensor | Sequence[float], group_size: int, cfg: LossConfig) -> Tensor:
    """Advantages [N] with the config's options: cfg.adv_std and cfg.leave_one_out."""
    return group_advantages(rewards, group_size, std=cfg.adv_std, leave_one_out=cfg.leave_one_out)


def ppo_clip(ratio: Tensor, advantages: Tensor, lo: float | Tensor, hi: float | Tensor) -> Tensor:
    """PPO's clipped objective per token, as PPO writes it: min(w*A, clip(w, lo, hi)*A)."""
    return torch.min(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages)


# ----------------------------------------------------------------------------- the general clip operator


class Clip(NamedTuple):
    """What the clip operator did to each token, all [B, T]; the three flags never overlap."""

    ratio: Tensor  # w where the token keeps its gradient; where stopped, the constant PPO clips it to
    w: Tensor  # the ratio itself, detached (gspo's: the sequence ratio): what the records keep
    low: Tensor  # bool: stopped below the rule's region
    high: Tensor  # bool: stopped above the rule's region
    limit: Tensor  # bool: stopped by ratio_limits or dual_clip while inside the region


def trust_region_clip(
    log_ratio: Tensor, advantages: Tensor, lo: float | Tensor, hi: float | Tensor, cfg: LossConfig, *, inside=None
) -> Clip:
    """ppo_clip for any region, written as the choice the min makes, with the flags of what it stopped.

    Inside [lo, hi] both terms of the min are w*A. Outside, the min takes clip(w)*A, a constant, exactly
    when the advantage pushes w further out, A*(w-1) > 0; a token the advantage pulls back in keeps w*A.
    So advantages * clip.ratio is ppo_clip's value and gradient. lo, hi: floats or float64 [B, T].
    inside: a region that is no interval of w (kl_full's), bool [B, T]; [lo, hi] then only places the
    stopped tokens' constant. cfg.ratio_limits intersect the region under the same choice; cfg.dual_clip
    c also stops tokens with A < 0 and w > c, which the region pulls back in (as (lo, c) also A > 0 and
    w < lo), at the value c (lo): dual-clip PPO's max(min(w*A, clip(w)*A), c*A).
    """
    ratio = log_ratio.exp()
    w = log_ratio.detach().double().exp()  # the region is decided in float64
    lo, hi = (torch.as_tensor(bound, dtype=torch.float64, device=w.device) for bound in (lo, hi))
    inside = (w >= lo) & (w <= hi) if inside is None else inside
    outward = advantages * (w - 1) > 0
    region = ~inside & outward
    limit_lo, limit_hi = cfg.ratio_limits or (0.0, math.inf)
    limit = ~region & outward & ((w < limit_lo) | (w > limit_hi))
    edge = w.clamp(lo.clamp_min(limit_lo), hi.clamp_max(limit_hi))  # where PPO's clip puts a stopped token
    if cfg.dual_clip is not None:
        dual_lo, dual_hi = _dual_bounds(cfg.dual_clip)
        pulled_far = ((advantages < 0) & (w > dual_hi)) | ((advantages > 0) & (w < dual_lo))
        limit, edge = limit | pulled_far, torch.where(pulled_far, w.clamp(dual_lo, dual_hi), edge)
    stopped = region | limit
    clipped = torch.where(stopped, edge.to(ratio.dtype), ratio)
    return Clip(clipped, ratio.detach(), region & (w < 1), region & (w > 1), limit)


def _dual_bounds(dual_clip: float | tuple[float, float]) -> tuple[float, float]:
    """(lo, hi) of a dual clip given as c (lo = 0: no lower edge) or as a pair (lo, hi)."""
    if isinstance(dual_clip, (int, float)):
        return 0.0, float(dual_clip)
    return float(dual_clip[0]), float(dual_clip[1])


# ----------------------------------------------------------------------------- the registry

LOG_RATIO_CAP = 20.0  # |log w| beyond this is held constant (no gradient): no bounded region reaches it
SEARCH_CAP = 700.0  # bisected bounds search log w in [-700, 700]; e^700 ~ 1e304 still fits float64
LIMIT_SETTINGS = ("ratio_limits", "dual_clip")  # the clip operator's own: every rule that calls it reads them
SEQUENCE_MEAN = "seq-mean-token-mean"
INPUTS = {  # what a trainer can hand policy_loss by name, when the config asks for it (required_inputs)
    "ref_logp": "[B, T] log-probs of the frozen reference (base) policy",
    "old_hidden": "[B, T, H] final hidden states of the sampling policy at the positions predicting each token",
    "hidden": "[B, T, H] the current policy's final hidden states at the same positions",
    "lm_head_weight": "[V, H] the output projection",
    "temperature": "float, the sampling temperature the log-probs use",
    "entropy": "[B, T] the current policy's entropy at each token's position (with its gradient for a bonus)",
    "sampler_logp": "[B, T] the sampler's own log-probs of the tokens, when old_logp is the training pass's",
}

Bounds = Callable[[Tensor, "LossConfig"], tuple]  # (mu float64 [B, T], cfg) -> (lo, hi), floats or [B, T]


@dataclass(frozen=True)
class Tokens:
    """What an objective receives: one micro-batch of completion tokens, tensors [B, T]."""

    logp: Tensor  # the current policy's log-probs; the gradient flows through them
    log_ratio: Tensor  # log w = logp - old_logp, clamped to +-LOG_RATIO_CAP, 0 off the mask (with gradient)
    mu: Tensor  # exp(old_logp), float64, constant: what a rule's bounds take
    adv: Tensor  # advantages broadcast to [B, T], constant
    mask: Tensor  # bool, True on completion tokens
    inputs: dict  # the rule's declared needs by name (see INPUTS)
    cfg: LossConfig
    rule: Rule


Objective = Callable[[Tokens], tuple[Tensor, Clip]]


@dataclass(frozen=True)
class Rule:
    """One entry of the registry: how its region enters the loss, the region's interval, what it reads.

    objective(tokens) -> (objective [B, T], clip): the per-token objective to maximize (policy_loss
    negates it, adds the KL penalty and aggregates; its gradient is the policy gradient) and the Clip
    whose flags the metrics and per-token records count.
    bounds(mu, cfg) -> (lo, hi): the ratio interval the rule admits at old probability mu; None for a
    soft rule, which has no region. A region that needs more than (w, mu) (kl_full) is decided in the
    objective from `needs`, and bounds is then its (w, mu) outer bound.
    settings: the LossConfig fields the rule reads; the configuration refuses the other rules' settings
    as doing nothing (inert_settings).
    delta, delta_high: the default sizes (delta may be a function of the config); None: no size.
    needs: the names from INPUTS the objective reads; the trainer passes them to policy_loss.
    aggregation: set for sequence-level rules, which are defined with it (LossConfig refuses another).
    """

    objective: Objective
    bounds: Bounds | None = None
    settings: tuple[str, ...] = LIMIT_SETTINGS
    delta: float | Callable[[LossConfig], float] | None = None
    delta_high: float | None = None
    needs: tuple[str, ...] = ()
    aggregation: str | None = None


def register(name: str, rule: Rule) -> Rule:
    """Add a rule under `name` (what --rule takes); everything that reads the registry then knows it."""
    if name in RULES:
        raise ValueError(f"rule {name!r} is registered already")
    unknown = sorted(set(rule.needs) - set(INPUTS))
    if unknown or rule.aggregation not in (None, *AGGREGATIONS):
        raise ValueError(f"rule {name!r}: needs {unknown} are not in INPUTS, or aggregation {rule.aggregation!r}")
    RULES[name] = rule
    return rule


def get_rule(rule: str | tuple[str, str]) -> Rule:
    """The Rule registered under a name; a GPPO cell also as (divergence, estimator)."""
    name = "-".join(rule) if isinstance(rule, tuple) else rule
    if name not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")
    return RULES[name]


def inside(rule: Rule, log_w: Tensor, old_logp: Tensor, cfg: LossConfig) -> Tensor:
    """Whether each token's ratio (log w, at its old log-probability) is inside the rule's interval."""
    if rule.bounds is None:
        return torch.ones_like(log_w, dtype=torch.bool)
    lo, hi = rule.bounds(old_logp.exp(), cfg)
    return (log_w.exp() >= lo) & (log_w.exp() <= hi)


def bisected(distance: Callable[[Tensor, Tensor, LossConfig], Tensor]) -> Bounds:
    """Bounds of the region distance(log_w, old_logp, cfg) <= cfg.delta where no closed form exists.

    Every such region is an interval in log w around 0: 64 bisection steps on each side, vectorized
    over mu, find its edges to float64 precision; an unbounded side is 0 or inf.
    """

    def bounds(mu: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
        old_logp = mu.log()

        def edge(direction: float) -> Tensor:
            inner, outer = torch.zeros_like(mu), torch.full_like(mu, direction * SEARCH_CAP)
            unbounded = distance(outer, old_logp, cfg) <= cfg.delta
            for _ in range(64):
                middle = (inner + outer) / 2
                ok = distance(middle, old_logp, cfg) <= cfg.delta
                inner, outer = torch.where(ok, middle, inner), torch.where(ok, outer, middle)
            return torch.where(unbounded, math.exp(direction * math.inf), inner.exp())

        return edge(-1.0), edge(1.0)

    return bounds


# ----------------------------------------------------------------------------- the rules: objectives


def ppo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    """PPO's clip on the rule's interval: the objective of every interval rule."""
    clip = trust_region_clip(t.log_ratio, t.adv, *t.rule.bounds(t.mu, t.cfg), t.cfg)
    return t.adv * clip.ratio, clip


def _gspo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Every token carries the sequence ratio s = exp(mean log w) as value and s * grad log pi_t as
    # gradient; averaged over the sequence that is exactly GSPO's A * grad s.
    lengths = t.mask.sum(-1, keepdim=True).clamp_min(1)
    seq_log_ratio = torch.where(t.mask, t.log_ratio, 0).sum(-1, keepdim=True) / lengths  # [B, 1]
    token_carries_seq = seq_log_ratio.detach() + t.log_ratio - t.log_ratio.detach()  # [B, T]
    clip = trust_region_clip(token_carries_seq, t.adv, *t.rule.bounds(t.mu, t.cfg), t.cfg)
    return t.adv * clip.ratio, clip


def _gmpo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # PPO's clip on each token (a stopped token sits at the edge of the region and the limits), then
    # the geometric mean of the clipped ratios times the sequence's mean advantage.
    clip = trust_region_clip(t.log_ratio, t.adv, *t.rule.bounds(t.mu, t.cfg), t.cfg)
    lengths = t.mask.sum(-1).clamp_min(1)
    seq_ratio = (torch.where(t.mask, clip.ratio.log(), 0).sum(-1) / lengths).exp()  # [B]
    seq_adv = torch.where(t.mask, t.adv, 0).sum(-1) / lengths  # [B]
    return (seq_adv * seq_ratio)[:, None].expand_as(t.log_ratio), clip


def _cispo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # w * sg(weight / w) has value `weight` and gradient weight * grad log pi: REINFORCE with a
    # truncated, stop-gradient importance weight, so the region never takes a token's gradient.
    # Its flags: `high` marks the truncated weights.
    clip = trust_region_clip(t.log_ratio, t.adv, 0.0, math.inf, t.cfg)  # the limits alone
    truncated = t.log_ratio.detach().double().exp() > t.rule.bounds(t.mu, t.cfg)[1]
    weight = torch.where(truncated, 1 + t.cfg.delta, clip.ratio.detach())
    objective = t.adv * clip.ratio * (weight / clip.ratio.detach())
    return objective, clip._replace(high=truncated, limit=clip.limit & ~truncated)


def _sapo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # d/dw of (4/tau) sigmoid(tau (w-1)) is 4 s (1-s), which is 1 at w = 1 and fades smoothly.
    clip = trust_region_clip(t.log_ratio, t.adv, 0.0, math.inf, t.cfg)  # the limits alone
    tau = torch.where(t.adv > 0, t.cfg.sapo_tau_pos, t.cfg.sapo_tau_neg)
    return t.adv * 4 / tau * torch.sigmoid(tau * (clip.ratio - 1)), clip


def _clip_cov_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Entropy collapse is driven by tokens with high cov(A, log pi); stop a random few of them.
    clip = trust_region_clip(t.log_ratio, t.adv, *t.rule.bounds(t.mu, t.cfg), t.cfg)
    cov = _token_covariance(t.logp, t.adv, t.mask)
    low, high = t.cfg.clip_cov_bounds
    candidate = ~(clip.low | clip.high | clip.limit) & (cov > low) & (cov < high)
    random_key = torch.where(candidate, torch.rand_like(cov), -math.inf)  # global RNG: seeded by the trainer
    picked = _top_tokens(random_key, max(1, int(t.cfg.cov_ratio * t.mask.sum())))
    below = clip.w < 1
    return (
        t.adv * torch.where(picked, clip.ratio.detach(), clip.ratio),
        clip._replace(low=clip.low | (picked & below), high=clip.high | (picked & ~below)),
    )


def _kl_cov_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Rather than stop the highest-covariance tokens, tie them to the old policy with |log w|.
    clip = trust_region_clip(t.log_ratio, t.adv, 0.0, math.inf, t.cfg)  # the limits alone
    picked = _top_tokens(_token_covariance(t.logp, t.adv, t.mask), max(1, int(t.cfg.cov_ratio * t.mask.sum())))
    return t.adv * clip.ratio - t.cfg.kl_cov_coef * picked * t.log_ratio.abs(), clip


def _kl_full_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # The one region that depends on more than the sampled token: the exact KL over the vocabulary
    # between the sampling and the current policy, a constant for the region test.
    x = t.inputs
    vocab_kl = full_vocab_kl(x["old_hidden"], x["hidden"], x["lm_head_weight"], temperature=x["temperature"])
    clip = trust_region_clip(t.log_ratio, t.adv, 0.0, math.inf, t.cfg, inside=vocab_kl <= t.cfg.delta)
    return t.adv * clip.ratio, clip


def _token_covariance(logp: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
    """Per-token cov(A, log pi) over the batch's tokens, [B, T], -inf off the mask."""
    count = mask.sum()
    adv_mean = torch.where(mask, adv, 0).sum() / count
    logp_mean = torch.where(mask, logp.detach(), 0).sum() / count
    cov = (adv - adv_mean) * (logp.detach() - logp_mean)
    return torch.where(mask, cov, -math.inf)


def _top_tokens(score: Tensor, count: int) -> Tensor:
    """Bool [B, T] marking the `count` highest scores among those > -inf."""
    top = score.flatten().topk(min(count, score.numel()))
    picked = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
    picked[top.indices[top.values > -math.inf]] = True
    return picked.view_as(score)


# ----------------------------------------------------------------------------- the rules: regions


def _lambertw(x: Tensor, branch: int) -> Tensor:
    """Lambert W on branch 0 or -1 for x in [-1/e, 0), by Halley iterations (float64)."""
    p = torch.sqrt((2 * (math.e * x + 1)).clamp_min(0))  # distance from the branch point x = -1/e
    sign = 1.0 if branch == 0 else -1.0
    w = -1 + sign * p - p**2 / 3 + sign * 11 / 72 * p**3  # series about the branch point
    if branch == -1:  # asymptotic start where the series is poor, near x = 0
        w = torch.where(x > -0.25, torch.log(-x) - torch.log(-torch.log(-x)), w)
    for _ in range(20):
        ew = torch.exp(w)
        f = w * ew - x
        denom = ew * (w + 1) - (w + 2) * f / (2 * w + 2)
        w = torch.where(w + 1 == 0, w, w - f / denom)
    return w


def _kl3_bounds(mu: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    # w - 1 - log w = d  <=>  (-w) e^(-w) = -e^(-1-d), so -w = W(-e^(-1-d)) on either real branch.
    x = torch.full_like(mu, -math.exp(-1 - cfg.delta))
    return -_lambertw(x, 0), -_lambertw(x, -1)


def _dcpo_bounds(mu: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    # Roots of mu*w*(1-w) = d and mu*w*(w-1) = d_high: the allowed change of the token's probability
    # shrinks as mu grows, so rare tokens may move further; DCPO caps the upper root at 10.
    lo = 0.5 + 0.5 * torch.sqrt((1 - 4 * cfg.delta / mu).clamp_min(0))
    hi = 0.5 + 0.5 * torch.sqrt(1 + 4 * cfg.delta_high / mu)
    return lo, hi.clamp_max(10.0)


class Divergence(NamedTuple):
    """A divergence f of the GPPO grid, as a function of log w, and the interval f(w) <= size."""

    f: Callable[[Tensor, LossConfig], Tensor]
    interval: Callable[[Tensor, LossConfig], tuple[Tensor, Tensor]]  # size: float64 tensor
    settings: tuple[str, ...] = ()  # the conventions it reads


def _tv_interval(size: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    edge = size * (2.0 if cfg.tv_half else 1.0)  # |w-1|/2 <= d is |w-1| <= 2d
    return (1 - edge).clamp_min(0), 1 + edge


def _kl_interval(size: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    return torch.exp(-size), torch.exp(size) if cfg.kl_two_sided else torch.full_like(size, math.inf)


DIVERGENCES: dict[str, Divergence] = {
    "tv": Divergence(lambda lw, cfg: torch.expm1(lw).abs() * (0.5 if cfg.tv_half else 1.0), _tv_interval, ("tv_half",)),
    "chi2": Divergence(
        lambda lw, cfg: torch.expm1(lw) ** 2, lambda s, cfg: ((1 - s.sqrt()).clamp_min(0), 1 + s.sqrt())
    ),
    "hellinger": Divergence(
        lambda lw, cfg: torch.expm1(lw / 2) ** 2, lambda s, cfg: ((1 - s.sqrt()).clamp_min(0) ** 2, (1 + s.sqrt()) ** 2)
    ),
    "kl": Divergence(lambda lw, cfg: lw.abs() if cfg.kl_two_sided else -lw, _kl_interval, ("kl_two_sided",)),
}


def binary_distance(f: Callable[[Tensor, LossConfig], Tensor]) -> Callable[[Tensor, Tensor, LossConfig], Tensor]:
    """f between the two-outcome distributions {token, rest}: the rest holds 1-mu before, 1-mu*w after."""

    def distance(log_w: Tensor, old_logp: Tensor, cfg: LossConfig) -> Tensor:
        rest_old = (-torch.expm1(old_logp)).clamp_min(1e-300)
        rest_new = -torch.expm1(old_logp + log_w)
        rest_log_ratio = torch.log(rest_new.clamp_min(0)) - torch.log(rest_old)
        value = old_logp.exp() * f(log_w, cfg) + rest_old * f(rest_log_ratio, cfg)
        return torch.where(rest_new < 0, math.inf, value)  # mu*w > 1 is no distribution

    return distance


def _grid_cell(divergence: Divergence, estimator: str) -> Rule:
    """GPPO's cell: mc f(w) <= d; atomic mu*f(w) <= d; binary f over {token, rest} <= d (bisected)."""
    bounds = {
        "mc": lambda mu, cfg: divergence.interval(torch.full_like(mu, cfg.delta), cfg),
        "atomic": lambda mu, cfg: divergence.interval(cfg.delta / mu, cfg),
        "binary": bisected(binary_distance(divergence.f)),
    }[estimator]
    f_of_08 = lambda cfg: round(divergence.f(torch.tensor(math.log(0.8), dtype=torch.float64), cfg).item(), 12)  # noqa: E731
    return Rule(ppo_objective, bounds, ("delta", *divergence.settings, *LIMIT_SETTINGS), delta=f_of_08)


def _clip_interval(mu: Tensor, cfg: LossConfig) -> tuple[float, float]:
    return max(1 - cfg.delta, 0.0), 1 + cfg.delta_high  # PPO's 1-d <= w <= 1+d_high (d_high = d unless set)


SIZE, SIZES = ("delta", *LIMIT_SETTINGS), ("delta", "delta_high", *LIMIT_SETTINGS)
KL3 = Rule(ppo_objective, _kl3_bounds, SIZE, delta=0.07)  # w - 1 - log w <= d, ATR-GRPO's region
RULES: dict[str, Rule] = {  # by the name --rule takes; each entry's comment is its region
    "grpo": Rule(ppo_objective, _clip_interval, SIZES, delta=0.2),  # 1-d <= w <= 1+d
    "dapo": Rule(ppo_objective, _clip_interval, SIZES, 0.2, 0.28),  # clip-higher: 1-d <= w <= 1+d_high
    "interval": Rule(ppo_objective, lambda mu, cfg: (0.0, math.inf)),  # everywhere: only the limits clip
    "kl1": Rule(ppo_objective, lambda mu, cfg: (math.exp(-cfg.delta), math.inf), SIZE, delta=-math.log(0.8)),
    "kl2": Rule(  # log^2(w)/2 <= d
        ppo_objective,
        lambda mu, cfg: (math.exp(-math.sqrt(2 * cfg.delta)), math.exp(math.sqrt(2 * cfg.delta))),
        SIZE,
        delta=math.log(0.8) ** 2 / 2,
    ),
    "kl3": KL3,
    "atr": KL3,
    "kl_full": Rule(  # the exact KL(old || new) over the vocabulary <= d; its (w, mu) outer bound is the Bernoulli KL
        _kl_full_objective,
        bisected(binary_distance(lambda lw, cfg: -lw)),
        SIZE,
        delta=0.07,
        needs=("old_hidden", "hidden", "lm_head_weight", "temperature"),
    ),
    "dcpo": Rule(ppo_objective, _dcpo_bounds, SIZES, 0.2, 0.28),  # mu*w*|w-1| <= d below, d_high above
    "dppo": Rule(  # DPPO's binary TV |pi - mu| = mu*|w-1| <= d: the band 1 +- d/mu
        ppo_objective, lambda mu, cfg: ((1 - cfg.delta / mu).clamp_min(0), 1 + cfg.delta / mu), SIZE, delta=0.2
    ),
    "gspo": Rule(_gspo_objective, _clip_interval, SIZES, 3e-4, 4e-4, aggregation=SEQUENCE_MEAN),  # on exp(mean log w)
    "gmpo": Rule(  # -d <= log w <= d_high per token, then the geometric mean of the ratios
        _gmpo_objective,
        lambda mu, cfg: (math.exp(-cfg.delta), math.exp(cfg.delta_high)),
        SIZES,
        delta=0.4,
        aggregation=SEQUENCE_MEAN,
    ),
    "cispo": Rule(_cispo_objective, lambda mu, cfg: (0.0, 1 + cfg.delta), SIZE, delta=0.2),  # weight truncated at 1+d
    "sapo": Rule(_sapo_objective, None, ("sapo_tau_pos", "sapo_tau_neg", *LIMIT_SETTINGS), aggregation=SEQUENCE_MEAN),
    "clip_cov": Rule(  # grpo's region, and a few tokens with high cov(A, log pi) also stop
        _clip_cov_objective,
        _clip_interval,
        ("delta", "delta_high", "cov_ratio", "clip_cov_bounds", *LIMIT_SETTINGS),
        0.2,
    ),
    "kl_cov": Rule(_kl_cov_objective, None, ("cov_ratio", "kl_cov_coef", *LIMIT_SETTINGS)),  # soft: |log w| penalty
    **{f"{f}-{e}": _grid_cell(d, e) for f, d in DIVERGENCES.items() for e in ("mc", "atomic", "binary")},
}


# ----------------------------------------------------------------------------- the configuration

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("off", "tis-token", "tis-seq", "mis-token", "mis-seq")


def _invalid(name: str, value, why: str) -> ValueError:
    """An error that names a field as its command-line flag: "--ratio-limits 2,1: ..."."""
    if isinstance(value, (tuple, list)):
        value = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return ValueError(f"--{name.replace('_', '-')} {value}: {why}")


def _numbers(name: str, value) -> float | tuple[float, ...] | None:
    """A number or tuple of numbers from a number, list (JSON) or "a,b" string (a command line; "" is None)."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        numbers = tuple(float(v) for v in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise _invalid(name, value, "expected numbers separated by commas") from None
    return numbers[0] if isinstance(value, str) and len(numbers) == 1 else numbers


@dataclass
class LossConfig:
    """Every knob of the loss and the advantages; config.py makes each field a flag (--delta-high ...).

    Fields left None take the rule's defaults from the table above. Tuple fields also take lists
    (a JSON round trip) and "a,b" strings (a command line).
    """

    rule: str | tuple[str, str] = field(
        default="grpo",
        metadata={
            "help": "clip rule: a name from loss.py's registry (grpo, dapo, atr, interval, ...), a GPPO cell "
            "divergence-estimator among them (kl-atomic, tv-binary, ...)"
        },
    )
    delta: float | None = field(
        default=None, metadata={"help": "trust-region size d; empty = the rule's default (grid cells: f(0.8))"}
    )
    delta_high: float | None = field(
        default=None,
        metadata={
            "help": "upper size d_high of the rules that read it (clip-higher); empty = delta times the rule's ratio"
        },
    )
    ratio_limits: tuple[float, float] | None = field(
        default=None,
        metadata={
            "help": "lo,hi: outer ratio limits intersected with the rule's interval (a token pushed outward "
            "past them loses its gradient); GPPO's [0.5, 10] read as limits; empty = none"
        },
    )
    dual_clip: float | tuple[float, float] | None = field(
        default=None,
        metadata={
            "help": "c: tokens with A < 0 and ratio > c lose their gradient; lo,hi: also A > 0 and ratio < lo "
            "(GPPO's [0.5, 10] read as mirrored dual clips); empty = off"
        },
    )
    aggregation: str | None = field(
        default=None,
        metadata={
            "help": "token-mean, seq-mean-token-mean or seq-mean-token-sum-norm; empty = the rule's own "
            "(seq-mean-token-mean for gspo, gmpo, sapo; token-mean otherwise)"
        },
    )
    norm_len: int | None = field(
        default=None, metadata={"help": "seq-mean-token-sum-norm's constant length; empty = the batch's T"}
    )
    adv_std: str = field(
        default="group",
        metadata={"help": "advantage scale: group (GRPO), batch (one std over the batch) or none (Dr. GRPO)"},
    )
    leave_one_out: bool = field(
        default=False,
        metadata={"help": "baseline = mean of the other G-1 rewards of the group instead of the group mean"},
    )
    kl_beta: float = field(default=0.0, metadata={"help": "weight of the KL penalty to the frozen base policy"})
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "weight of an entropy bonus: the loss subtracts entropy_coef x the policy's token entropy, "
            "aggregated like the loss; 0 = off"
        },
    )
    kl_estimator: str = field(
        default="k3",
        metadata={"help": "KL penalty estimator: k1 log(pi/ref), k2 log^2(pi/ref)/2, k3 ref/pi - 1 - log(ref/pi)"},
    )
    tv_half: bool = field(
        default=False,
        metadata={
            "help": "TV = |w-1|/2 instead of |w-1|: tv cells' default delta becomes 0.1 (interval unchanged, "
            "[0.8, 1.2] for tv-mc), and delta 0.2 gives tv-mc [0.6, 1.4]"
        },
    )
    kl_two_sided: bool = field(
        default=True,
        metadata={
            "help": "kl cells use |log w|; false: -log w, so kl-mc at 0.223 is [0.8, inf) instead of "
            "[0.8, 1.25] and kl-binary is the exact Bernoulli KL"
        },
    )
    sapo_tau_pos: float = field(default=1.0, metadata={"help": "sapo: gate temperature for A > 0"})
    sapo_tau_neg: float = field(
        default=1.05, metadata={"help": "sapo: gate temperature for A < 0 (sharper: negative updates fade faster)"}
    )
    cov_ratio: float = field(
        default=2e-4, metadata={"help": "clip_cov, kl_cov: fraction of tokens selected by cov(A, log pi)"}
    )
    clip_cov_bounds: tuple[float, float] = field(
        default=(1.0, 5.0), metadata={"help": "clip_cov: lo,hi covariance window the stopped tokens are drawn from"}
    )
    kl_cov_coef: float = field(default=1.0, metadata={"help": "kl_cov: weight of |log w| on the selected tokens"})
    rollout_correction: str = field(
        default="off",
        metadata={
            "help": "sampler-trainer mismatch correction, a weight on each token's policy-gradient term from "
            "rho = pi_train_old / pi_sampler (needs --recompute-old-logp): tis-token min(rho_t, C), tis-seq "
            "min(prod rho_t, C), mis-token rho_t 1[rho_t <= C], mis-seq the same per sequence (Yao et al. 2025, "
            "'Your efficient RL framework secretly brings you off-policy RL training'; TRL's vllm_importance_sampling_"
            "mode, verl's rollout_correction); off"
        },
    )
    rollout_correction_cap: float = field(
        default=2.0, metadata={"help": "--rollout-correction's cap C >= 1 (verl's default 2; TRL's 3)"}
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "q in (0, 1]: only the tokens whose entropy is in the top q of the micro-batch carry the "
            "policy gradient (Wang et al. 2025, 'Beyond the 80/20 rule: high-entropy minority tokens drive RL "
            "for LLM reasoning'; TRL's top_entropy_quantile); 1 = every token"
        },
    )

    def __post_init__(self):
        if isinstance(self.rule, str) and self.rule.split("-")[0] in DIVERGENCES:
            self.rule = tuple(self.rule.split("-", 1))  # "kl-atomic", as a command line spells it
        elif isinstance(self.rule, list):
            self.rule = tuple(self.rule)
        for name in ("ratio_limits", "dual_clip", "clip_cov_bounds"):
            setattr(self, name, _numbers(name, getattr(self, name)))
        try:
            rule = get_rule(self.rule)
        except ValueError as error:
            raise _invalid("rule", self.rule, str(error)) from None
        if self.delta is None:
            self.delta = rule.delta(self) if callable(rule.delta) else rule.delta
        if self.delta_high is None and self.delta is not None:
            self.delta_high = self.delta * (rule.delta_high / rule.delta if rule.delta_high else 1.0)
        if self.aggregation is None:
            self.aggregation = rule.aggregation or "token-mean"
        elif rule.aggregation not in (None, self.aggregation):
            raise _invalid(
                "aggregation",
                self.aggregation,
                f"rule {self.rule} is sequence-level and is defined "
                f"with {rule.aggregation}; leave --aggregation unset for it",
            )
        self._validate()

    def _validate(self):
        for f in dataclasses.fields(self):  # nan is no value; a scalar size or weight is finite too
            value = getattr(self, f.name)
            if (
                isinstance(value, tuple)
                and any(isinstance(v, float) and math.isnan(v) for v in value)
                or isinstance(value, float)
                and not math.isfinite(value)
            ):
                raise _invalid(f.name, value, "must be a finite number")
        limits, dual, window = self.ratio_limits, self.dual_clip, self.clip_cov_bounds
        for name, ok, why in (
            ("delta", self.delta is None or self.delta >= 0, "must be >= 0"),
            ("delta_high", self.delta_high is None or self.delta_high >= 0, "must be >= 0"),
            (
                "ratio_limits",
                limits is None or (isinstance(limits, tuple) and len(limits) == 2 and 0 <= limits[0] < 1 < limits[1]),
                "expected lo,hi with 0 <= lo < 1 < hi",
            ),
            ("dual_clip", dual is None or _valid_dual_clip(dual), "expected c > 1, or lo,hi with 0 < lo < 1 < hi"),
            ("aggregation", self.aggregation in AGGREGATIONS, f"expected one of {', '.join(AGGREGATIONS)}"),
            ("norm_len", self.norm_len is None or self.norm_len >= 1, "must be >= 1"),
            ("adv_std", self.adv_std in ADV_STDS, f"expected one of {', '.join(ADV_STDS)}"),
            ("kl_beta", self.kl_beta >= 0, "must be >= 0"),
            ("entropy_coef", self.entropy_coef >= 0 and math.isfinite(self.entropy_coef), "must be >= 0"),
            ("kl_estimator", self.kl_estimator in KL_ESTIMATORS, f"expected one of {', '.join(KL_ESTIMATORS)}"),
            ("sapo_tau_pos", self.sapo_tau_pos > 0, "must be > 0"),
            ("sapo_tau_neg", self.sapo_tau_neg > 0, "must be > 0"),
            ("cov_ratio", 0 < self.cov_ratio <= 1, "must be in (0, 1]"),
            (
                "clip_cov_bounds",
                isinstance(window, tuple) and len(window) == 2 and window[0] < window[1],
                "expected lo,hi with lo < hi",
            ),
            ("kl_cov_coef", self.kl_cov_coef >= 0, "must be >= 0"),
            (
                "rollout_correction",
                self.rollout_correction in ROLLOUT_CORRECTIONS,
                f"expected one of {', '.join(ROLLOUT_CORRECTIONS)}",
            ),
            ("rollout_correction_cap", self.rollout_correction_cap >= 1, "must be >= 1 (a weight of 1 is no change)"),
            ("top_entropy_quantile", 0 < self.top_entropy_quantile <= 1, "must be in (0, 1]"),
        ):
            if not ok:
                raise _invalid(name, getattr(self, name), why)


def _valid_dual_clip(dual_clip) -> bool:
    if isinstance(dual_clip, (int, float)):
        return dual_clip > 1
    return len(dual_clip) == 2 and 0 < dual_clip[0] < 1 < dual_clip[1]


def required_inputs(cfg: LossConfig) -> frozenset[str]:
    """The names policy_loss needs beyond the log-probs: the rule's declared needs, ref_logp for a KL penalty,
    the entropy for an entropy bonus (differentiable) or an entropy selection, and the sampler's log-probs for
    a rollout correction."""
    return (
        frozenset(get_rule(cfg.rule).needs)
        | ({"ref_logp"} if cfg.kl_beta > 0 else set())
        | ({"entropy"} if cfg.entropy_coef > 0 or cfg.top_entropy_quantile < 1 else set())
        | ({"sampler_logp"} if cfg.rollout_correction != "off" else set())
    )


def inert_settings(cfg: LossConfig) -> dict[str, str]:
    """The fields that change nothing with this rule and aggregation, each with the reason: a flag given
    for one of them can only be a mistake (config.check_given refuses it). A rule setting is inert when
    the rule's entry does not declare it; the rules that do are named from the registry."""
    shown = "-".join(cfg.rule) if isinstance(cfg.rule, tuple) else cfg.rule
    readers: dict[str, list[str]] = {}
    for name, rule in RULES.items():
        for setting in rule.settings:
            readers.setdefault(setting, []).append(name)
    own = get_rule(cfg.rule).settings
    inert = {  # delta is every sized rule's trust-region size: a rule without it has none
        setting: f"--rule {shown} {'has no trust-region size' if setting == 'delta' else 'does not read it'}"
        f" (read by {_listed(names)})"
        for setting, names in readers.items()
        if setting not in own
    }
    if cfg.aggregation != "seq-mean-token-sum-norm":
        inert["norm_len"] = f"only --aggregation seq-mean-token-sum-norm divides by it, not {cfg.aggregation}"
    if cfg.kl_beta == 0:
        inert["kl_estimator"] = "the KL penalty is off (--kl-beta 0)"
    if cfg.rollout_correction == "off":
        inert["rollout_correction_cap"] = "the rollout correction is off (--rollout-correction off)"
    return inert


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


# ----------------------------------------------------------------------------- the loss

MU_EDGES = (0.01, 0.1, 0.5, 0.9)  # old-probability buckets for the diagnostics
MU_LABELS = ("<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">0.9")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | Tensor | None = None,
    records: list | None = None,
    **inputs,
) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient loss of cfg.rule and its diagnostics.

    Per token: -objective, + kl_beta x the KL estimate to the reference, - entropy_coef x the entropy;
    then aggregated. logp, old_logp, mask: [B, T] (mask True on completion tokens); advantages: [B] or [B, T].
    Aggregation: token-mean = sum / num_tokens; seq-mean-token-mean = sum of per-sequence means /
    num_seqs; seq-mean-token-sum-norm (Dr. GRPO) = sum / (num_seqs * norm_len). For gradient
    accumulation pass the whole optimizer step's num_tokens / num_seqs (default: this batch's) and
    sum the micro-batch losses.
    inputs: by name, every one of required_inputs(cfg) (see INPUTS); others from INPUTS are ignored.
    records: a list to which one dict of numpy arrays per call is appended, one entry per masked
    token (mu, w, advantage, region_low, region_high, limit), for write_token_records.
    metrics: plain floats, clip fractions over all tokens (region below / above, limits), the share of
    tokens with non-zero advantage and the fraction of those any clip stopped (active_share,
    active_clip_frac), k3 KL, ratio range, and a table by old-probability bucket (metric_share says
    which tokens each value is a mean over).
    """
    rule = get_rule(cfg.rule)
    mask, adv = _check_inputs(logp, old_logp, advantages, mask, cfg, inputs)
    old_logp = old_logp.detach()  # the sampling policy is a constant
    log_ratio = torch.where(mask, logp - old_logp, 0).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)  # [B, T]
    objective, clip = rule.objective(Tokens(logp, log_ratio, old_logp.double().exp(), adv, mask, inputs, cfg, rule))
    extra = {}
    if cfg.rollout_correction != "off":
        weight = correction_weight(old_logp, inputs["sampler_logp"].detach(), mask, cfg)  # [B, T], constant
        objective = objective * weight.to(objective.dtype)
        extra |= _weight_metrics(weight, mask)
    if cfg.top_entropy_quantile < 1:
        selected = top_entropy_tokens(inputs["entropy"].detach(), mask, cfg.top_entropy_quantile)
        objective = torch.where(selected, objective, 0)
        extra["entropy_selected_frac"] = float(selected.sum() / mask.sum())
    token_loss, ref_kl = -objective, None
    if cfg.kl_beta:
        ref_kl = _reference_kl(logp, inputs["ref_logp"].detach(), cfg.kl_estimator)
        token_loss = token_loss + cfg.kl_beta * ref_kl
    if cfg.entropy_coef:
        token_loss = token_loss - cfg.entropy_coef * inputs["entropy"]
    loss = _aggregate(token_loss, mask, cfg, num_tokens, num_seqs)
    if records is not None:
        records.append(_token_record(old_logp, adv, mask, clip))
    return loss, _metrics(log_ratio, old_logp, adv, mask, clip, ref_kl) | extra


def correction_weight(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cfg: LossConfig) -> Tensor:
    """The rollout correction's weight per token [B, T] float64 (1 off the mask), from rho = pi_old / pi_sampler:
    the training pass's old log-probs over the sampler's, of the same tokens.

        tis-token  min(rho_t, C)                  mis-token  rho_t * 1[rho_t <= C]
        tis-seq    min(prod_t rho_t, C)           mis-seq    prod_t rho_t * 1[prod_t rho_t <= C]

    Truncation (TIS) bounds the weight's variance at a bias; masking (MIS) drops the tokens or sequences the
    sampler got far off instead. With equal log-probs rho is exactly 1 and so is every weight."""
    log_rho = torch.where(mask, old_logp.double() - sampler_logp.double(), 0)  # [B, T]
    if cfg.rollout_correction.endswith("-seq"):
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)  # the sequence's log prod rho_t on each token
    rho, cap = log_rho.exp(), cfg.rollout_correction_cap
    weight = rho.clamp_max(cap) if cfg.rollout_correction.startswith("tis") else torch.where(rho <= cap, rho, 0)
    return torch.where(mask, weight, 1.0)


@torch.no_grad()
def _weight_metrics(weight: Tensor, mask: Tensor) -> dict[str, float]:
    w = weight[mask]
    stats = torch.stack([w.mean(), w.min(), w.max(), (w == 0).double().mean()]).tolist()
    return dict(
        zip(
            ("correction_weight_mean", "correction_weight_min", "correction_weight_max", "correction_masked_frac"),
            stats,
        )
    )


def top_entropy_tokens(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """Bool [B, T]: the masked tokens whose entropy is at least the (1 - quantile) quantile of the masked
    tokens' entropies (ties at the threshold all kept), as TRL's top_entropy_quantile selects them."""
    threshold = torch.quantile(entropy[mask].float(), 1 - quantile)
    return mask & (entropy >= threshold)


@torch.no_grad()
def mismatch(sampler_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler's log-probs of the tokens are from the training pass's, over the masked tokens:
    mean and max |d log p|, the k3 estimate of KL(sampler || trainer) (r - 1 - log r, r = pi_train / pi_sampler,
    the tokens being the sampler's samples), and the fraction of tokens with r outside [0.5, 2]."""
    log_r = (trainer_logp.double() - sampler_logp.double())[mask.bool()]  # [n]
    stats = torch.stack(
        [
            log_r.abs().mean(),
            log_r.abs().max(),
            (torch.expm1(log_r) - log_r).mean(),
            (log_r.abs() > math.log(2)).double().mean(),
        ]
    ).tolist()
    return dict(zip(("mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3", "mismatch/out_frac"), stats))


def _check_inputs(logp, old_logp, advantages, mask, cfg, inputs) -> tuple[Tensor, Tensor]:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise ValueError(f"unknown inputs {', '.join(unknown)}; policy_loss takes {', '.join(INPUTS)}")
    missing = sorted(required_inputs(cfg) - set(inputs))
    if missing:
        raise ValueError(
            f"rule {cfg.rule!r} with kl_beta={cfg.kl_beta} needs the inputs {', '.join(missing)} (see loss.INPUTS)"
        )
    for name, t in (
        ("old_logp", old_logp),
        ("mask", mask),
        ("ref_logp", inputs.get("ref_logp")),
        ("entropy", inputs.get("entropy")),
        ("sampler_logp", inputs.get("sampler_logp")),
    ):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logp's {tuple(logp.shape)}")
    for name in ("old_hidden", "hidden"):
        if name in inputs and (inputs[name].dim() != 3 or inputs[name].shape[:2] != logp.shape):
            raise ValueError(
                f"{name} has shape {tuple(inputs[name].shape)}, expected [B, T, H] with [B, T] = {tuple(logp.shape)}"
            )
    if "temperature" in inputs and not inputs["temperature"] > 0:
        raise ValueError(f"temperature must be > 0, got {inputs['temperature']}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be [B] or [B, T] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    mask = mask.bool()
    if not mask.any():
        raise ValueError("mask has no tokens: the loss would be a silent zero")
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
    return mask, adv.detach().to(logp.dtype)


def _reference_kl(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    log_ref_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)  # log(ref / pi), samples from pi
    if estimator == "k1":
        return -log_ref_ratio
    if estimator == "k2":
        return log_ref_ratio**2 / 2
    return torch.expm1(log_ref_ratio) - log_ref_ratio  # k3: unbiased and never negative


def _aggregate(token_loss: Tensor, mask: Tensor, cfg: LossConfig, num_tokens, num_seqs) -> Tensor:
    """Sum over the micro-batch divided by a whole-step normalizer, so micro-batch losses add up."""
    token_loss = torch.where(mask, token_loss, 0)
    if cfg.aggregation == "token-mean":
        return token_loss.sum() / (num_tokens if num_tokens is not None else mask.sum())
    seqs = num_seqs if num_seqs is not None else mask.any(-1).sum()
    if cfg.aggregation == "seq-mean-token-mean":
        return (token_loss.sum(-1) / mask.sum(-1).clamp_min(1)).sum() / seqs
    return token_loss.sum() / (seqs * (cfg.norm_len or mask.shape[-1]))  # Dr. GRPO: a constant length


@torch.no_grad()
def _metrics(log_ratio, old_logp, adv, mask, clip: Clip, ref_kl) -> dict[str, float]:
    log_w, a = log_ratio[mask].double(), adv[mask].double()
    low, high, limit = clip.low[mask].double(), clip.high[mask].double(), clip.limit[mask].double()
    w = log_w.exp()
    stats = {
        "clip_low_frac": low.mean(),  # stopped by the rule's region
        "clip_high_frac": high.mean(),
        "limit_clip_frac": limit.mean(),  # stopped by ratio_limits or dual_clip
        "approx_kl": (torch.expm1(log_w) - log_w).mean(),  # k3 estimate of KL(old || new)
        "ratio_min": w.min(),
        "ratio_mean": w.mean(),
        "ratio_max": w.max(),
    }
    if ref_kl is not None:
        stats["ref_kl"] = ref_kl.detach()[mask].double().mean()
    edges = torch.tensor(MU_EDGES, dtype=torch.float64, device=log_w.device)
    bucket = F.one_hot(torch.bucketize(old_logp[mask].double().exp(), edges), len(MU_LABELS)).double()  # [n, 5]
    count = bucket.sum(0).clamp_min(1)
    share, sign = bucket.sum(0) / len(w), (bucket * a.sign()[:, None]).sum(0) / count
    region_clip, limit_clip = (bucket * (low + high)[:, None]).sum(0) / count, (bucket * limit[:, None]).sum(0) / count
    # A token with zero advantage has no gradient to stop: the rates over the others say how often a clip acts.
    active = (a != 0).double()
    stopped = (low + high + limit) * active
    stats |= {"active_share": active.mean(), "active_clip_frac": stopped.sum() / active.sum().clamp_min(1)}
    active_count = (bucket * active[:, None]).sum(0)
    active_share, active_clip = active_count / len(w), (bucket * stopped[:, None]).sum(0) / active_count.clamp_min(1)
    for i, label in enumerate(MU_LABELS):
        stats |= {
            f"mu[{label}]/share": share[i],
            f"mu[{label}]/adv_sign": sign[i],
            f"mu[{label}]/clip_frac": region_clip[i],
            f"mu[{label}]/limit_frac": limit_clip[i],
            f"mu[{label}]/active_share": active_share[i],
            f"mu[{label}]/active_clip_frac": active_clip[i],
        }
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # one device sync


def metric_share(key: str) -> str | None:
    """The metric that gives the share of a micro-batch's tokens `key` is a mean over (None: all of them).

    Merging micro-batches weights each one's value by its tokens times that share: mu[BUCKET]/clip_frac is a
    mean over the bucket's tokens (mu[BUCKET]/share), active_clip_frac over the tokens with non-zero
    advantage (active_share), mu[BUCKET]/active_clip_frac over the bucket's such tokens.
    """
    bucket, _, name = key.rpartition("/")
    if name in ("share", "active_share") or not (bucket.startswith("mu[") or key == "active_clip_frac"):
        return None
    if key == "active_clip_frac":
        return "active_share"
    return f"{bucket}/active_share" if name.startswith("active_") else f"{bucket}/share"


def merge_metrics(metrics: list[dict]) -> dict:
    """One step's metrics from its micro-batches': *_min and *_max are extremes, the rest token-weighted means.

    A mean over some of the tokens (a bucket's mu[BUCKET]/adv_sign, ...) is weighted by those tokens (tokens x
    the share metric_share names), so the merged value is the whole step's whichever way its rows were
    split into micro-batches or ranks.
    """
    tokens = np.array([m["tokens"] for m in metrics], dtype=np.float64)
    merged = {}
    for key in metrics[0]:
        values = np.array([m[key] for m in metrics], dtype=np.float64)
        if key.endswith("_min") or key.endswith("_max"):
            merged[key] = float(values.min() if key.endswith("_min") else values.max())
            continue
        share = metric_share(key)
        weights = tokens * [m[share] for m in metrics] if share else tokens
        merged[key] = float(values @ weights / weights.sum()) if weights.sum() else 0.0
    del merged["tokens"]
    return merged


def clip_rates(metrics: list[dict]) -> dict:
    """How often the clips act: of the tokens with non-zero advantage in these micro-batches (a step's updates
    after the rollout's first, where w = 1 and nothing clips), the fraction any clip stopped, overall and per
    old-probability bucket (clip_rate, mu[BUCKET]/clip_rate; None without such tokens), and how many tokens
    each is over (*_tokens). clip_low_frac and the other *_frac count over every token instead."""
    rates = {}
    for prefix in ["", *(f"mu[{label}]/" for label in MU_LABELS)]:
        counts = np.array([m["tokens"] * m[f"{prefix}active_share"] for m in metrics], dtype=np.float64)
        clipped = float(np.array([m[f"{prefix}active_clip_frac"] for m in metrics]) @ counts) if metrics else 0.0
        rates[f"{prefix}clip_rate"] = clipped / float(counts.sum()) if counts.sum() else None  # a float, not numpy
        rates[f"{prefix}clip_rate_tokens"] = int(round(counts.sum()))
    return rates


@torch.no_grad()
def _token_record(old_logp: Tensor, adv: Tensor, mask: Tensor, clip: Clip) -> dict[str, np.ndarray]:
    """One entry per masked token: mu, w (the ratio the rule clips: gspo's is the sequence ratio),
    advantage, and the clip flags region_low, region_high, limit (the ones the metrics count)."""
    tiny = torch.finfo(torch.float32).tiny  # float32 keeps mu > 0 for the calibration's checks

    def column(x: Tensor, dtype) -> np.ndarray:
        return x[mask].to(dtype).cpu().numpy()

    return {
        "mu": column(old_logp.double().exp().clamp_min(tiny), torch.float32),
        "w": column(clip.w, torch.float32),
        "advantage": column(adv, torch.float32),
        "region_low": column(clip.low, torch.bool),
        "region_high": column(clip.high, torch.bool),
        "limit": column(clip.limit, torch.bool),
    }


@torch.no_grad()
def full_vocab_kl(
    old_hidden: Tensor, new_hidden: Tensor, lm_head_weight: Tensor, *, temperature: float = 1.0, chunk_tokens: int = 256
) -> Tensor:
    """Exact KL(old || new) of the next-token distributions over the whole vocabulary, [B, T] float32.

    old_hidden, new_hidden: [B, T, H] final hidden states (after the last norm) of the sampling and
    the current policy at the positions whose lm_head output scores logp's tokens; lm_head_weight:
    [V, H], frozen. Cost: one extra lm_head matmul per token for the old and for the new states
    (2 * 2*H*V FLOPs per token), and O(chunk_tokens * V) float32 memory, never [B, T, V].
    """
    if old_hidden.shape != new_hidden.shape or old_hidden.dim() != 3 or old_hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"old_hidden {tuple(old_hidden.shape)} and new_hidden {tuple(new_hidden.shape)} must be "
            f"[B, T, H] with H = lm_head_weight.shape[1] = {lm_head_weight.shape[1]}"
        )
    old_flat, new_flat = old_hidden.flatten(0, 1), new_hidden.flatten(0, 1)  # [B*T, H]
    kl = torch.empty(old_flat.shape[0], dtype=torch.float32, device=old_hidden.device)
    for start in range(0, old_flat.shape[0], chunk_tokens):  # chunks of tokens, each [chunk, V]
        chunk = slice(start, start + chunk_tokens)
        old_logp = F.log_softmax((old_flat[chunk] @ lm_head_weight.T).float() / temperature, dim=-1)
        new_logp = F.log_softmax((new_flat[chunk] @ lm_head_weight.T).float() / temperature, dim=-1)
        kl[chunk] = (old_logp.exp() * (old_logp - new_logp)).sum(-1).clamp_min(0)
    return kl.view(old_hidden.shape[:2])


# ----------------------------------------------------------------------------- intervals


def as_probabilities(name: str, x) -> Tensor:
    """x as float64 probabilities in (0, 1]; a ValueError naming it otherwise."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if not ((x > 0) & (x <= 1)).all():
        raise ValueError(f"{name} must be probabilities in (0, 1]")
    return x


def ratio_bounds(rule: str | tuple[str, str], delta: float | None, mu, **options) -> tuple[Tensor, Tensor]:
    """The ratio interval [lo, hi] a rule admits at old probability mu (float or tensor), float64.

    An unbounded side is 0 or inf. options: other LossConfig fields (delta_high, tv_half, kl_two_sided,
    ratio_limits: the interval is then intersected with the limits).
    """
    cfg = LossConfig(rule=rule, delta=delta, **options)
    spec = get_rule(cfg.rule)
    mu = as_probabilities("mu", mu)
    if spec.bounds is None:
        raise ValueError(f"rule {rule!r} has no trust region, so no ratio interval")
    lo, hi = (torch.zeros_like(mu) + bound for bound in spec.bounds(mu, cfg))  # floats become [mu's shape]
    if cfg.ratio_limits is not None:
        lo, hi = lo.clamp_min(cfg.ratio_limits[0]), hi.clamp_max(cfg.ratio_limits[1])
    return lo, hi
