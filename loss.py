"""Group-relative advantages and one policy loss whose trust region is a pluggable constraint.

A token's ratio is w = exp(logp - old_logp); mu = exp(old_logp) is its probability under the policy
that sampled it. A rule names a trust region, a constraint on (w, mu) with size delta, and one clip
operator turns every region into a loss: inside PPO's min(w*A, clip(w)*A) a token keeps its gradient
-A*w/N unless it is outside the region AND its advantage pushes it further out (A > 0 above, A < 0
below); then its gradient is exactly zero. Rules that are not hard regions are short functions with
the same output. Intervals below are ratio_bounds(rule, default delta, mu).

rule          inside the region (d = delta, d_high = delta_high)       default d     mu=0.5          mu=0.05
grpo          1-d <= w <= 1+d                                          0.2           [0.8, 1.2]      same
dapo          1-d <= w <= 1+d_high (clip-higher)                       0.2, 0.28     [0.8, 1.28]     same
interval      everywhere: only ratio_limits clip (the control arm      none          (0, inf)        same
              "lower 0.5, upper 10" is rule="interval", ratio_limits=(0.5, 10))
kl1           -log w <= d (one-sided by construction)                  KL1(0.8)=.223 [0.8, inf)      same
kl2           log^2(w)/2 <= d; bounds exp(-+sqrt(2d))                  KL2(0.8)=.025 [0.8, 1.25]     same
kl3, atr      w - 1 - log w <= d; bounds by Lambert W (ATR-GRPO)       0.07          [0.671, 1.422]  same
kl_full       exact KL(old || new) over the vocabulary <= d (*)        0.07          [0.639, 1.361]  [0.103, 3.47]
dcpo          mu*w*(1-w) <= d, w >= 1/2 below 1; mu*w*(w-1) <= d_high, 0.2, 0.28     [0.5, 1.4]      [0.5, 2.92]
              w <= 10 above (DCPO: rare tokens may move further)
dppo          |pi - mu| = mu*|w-1| <= d: the band 1 +- d/mu (DPPO's        0.2           [0.6, 1.4]      [0, 5]
              Binary-TV, GPPO's Eq. 24)
(f, est)      the GPPO grid below, e.g. ("kl", "atomic") or "kl-atomic"  f(0.8)
gspo          1-d <= s <= 1+d_high on the sequence ratio               3e-4, 4e-4    [.9997, 1.0004] same
              s = exp(mean log w) (GSPO; seq-mean-token-mean)
gmpo          |log w| <= d per token, loss A * geometric mean of the   0.4           [0.670, 1.492]  same
              clipped ratios (GMPO; seq-mean-token-mean)
cispo         soft: gradient sg(min(w, 1+d)) * A * grad log pi for     0.2           [0, 1.2]        same
              every token; the interval is where w is not truncated (CISPO)
sapo          soft: A * (4/tau) sigmoid(tau (w-1)), tau 1.0 for A > 0, 1.05 for A < 0; weight 1 at w = 1
              (SAPO; its reference averages seq-mean-token-mean)
clip_cov      grpo's region, and a random cov_ratio = 2e-4 of tokens   0.2           [0.8, 1.2]      same
              with cov(A, logp) in (1, 5) also lose their gradient
kl_cov        no clip; the top 2e-4 of tokens by cov(A, logp) add 1.0 * |log w| to their loss
(*) The region depends on the whole distribution, so the rule needs the hidden states (Rule.needs);
    its interval is the tight outer bound KL(Bernoulli(mu) || Bernoulli(mu*w)) <= d: merging the
    vocabulary into {token, rest} can only lower a KL. d = ATR's, as k3 estimates this KL without bias.
Sequence-level rules (gspo, gmpo, sapo) default to seq-mean-token-mean and refuse another aggregation.

The GPPO grid: divergence f (tv |w-1|, chi2 (w-1)^2, hellinger (sqrt(w)-1)^2, kl |log w|) times an
estimator: mc f(w) <= d; atomic mu*f(w) <= d; binary mu*f(w) + (1-mu)*f((1-mu*w)/(1-mu)) <= d, the
divergence between the two-outcome distributions {token, rest}. GRPO = (tv, mc), DAPO-like = (kl, mc),
RIPO = (chi2, atomic). Default d = f(0.8), GRPO's lower edge: tv 0.2, chi2 0.04, hellinger 0.0111, kl
0.223. At mu = 0.5 / 0.05: (kl, mc) [0.8, 1.25] / same; (tv, binary) [0.8, 1.2] / [0, 3]; (chi2, atomic)
[0.717, 1.283] / [0.106, 1.894]; (kl, atomic) [0.640, 1.562] / [0.012, 86.7].
Conventions, where papers differ: TV is |w-1| without the 1/2; tv_half=True halves it, so the default
d becomes 0.1 (the intervals stay the same) and d = 0.2 gives (tv, mc) [0.6, 1.4]. Without the 1/2 the
tv cells read: (tv, mc) |w-1| <= d; (tv, atomic) mu*|w-1| <= d, the band 1 +- d/mu; (tv, binary) counts
the token and the rest, mu*|w-1| + |mu - mu*w| = 2*mu*|w-1| <= d, the band 1 +- d/(2 mu), so its default
d = 0.2 is 1 +- 0.1/mu ([0, 3] at mu = 0.05). DPPO's Binary-TV is |pi - mu| = mu*|w-1|, TV with the 1/2:
its band 1 +- 0.2/mu ([0, 5] at mu = 0.05) is the `dppo` rule, equal to (tv, atomic) at d = 0.2 and to
(tv, binary) with tv_half=True at d = 0.2, which also caps w at 1/mu (no probability exceeds 1).
The kl region is two-sided, |log w| <= d; kl_two_sided=False uses -log w: mc and atomic then bound only
decreases ((kl, mc) [0.8, inf); (kl, atomic) at mu = 0.05 [0.012, inf)) and (kl, binary) becomes the
exact Bernoulli KL.

GPPO's "[0.5, 10]" has two readings, and both are here. dual_clip=(0.5, 10): two mirrored dual clips,
a token the region pulls back in (A < 0 above 10, A > 0 below 0.5) loses its gradient; the region
itself is unchanged. ratio_limits=(0.5, 10): outer limits intersected with the rule's interval under
the same clip operator, so a token pushed outward past 10 or below 0.5 stops even where the cell
would admit it (the reading of the review's arithmetic: (kl, atomic)'s upper bound passes 10 below
mu = 0.097, and from there the limit acts instead of the cell).

Numerics: log w is clamped to [-20, 20] before exp (e^20 ~ 5e8 is outside every bounded region),
regions are evaluated in float64 on log w, and groups with equal rewards get exactly zero advantage.

The per-token records a run writes (train.py --log-tokens N) and the comparison of rules at equal clip
rate over them are calibrate.py's: they work on run directories, not on a batch.
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

LOG_RATIO_CAP = 20.0  # |log w| beyond this is held constant (no gradient): no bounded region reaches it
SEARCH_CAP = 700.0  # ratio_bounds searches log w in [-700, 700]; e^700 ~ 1e304 still fits float64
DCPO_MAX_RATIO = 10.0  # DCPO caps its dynamic upper bound here
MU_EDGES = (0.01, 0.1, 0.5, 0.9)  # old-probability buckets for the diagnostics
MU_LABELS = ("<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">0.9")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ADV_STDS = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
INPUTS = {  # what a trainer can hand policy_loss by name, when the config asks for it (required_inputs)
    "ref_logp": "[B, T] log-probs of the frozen reference (base) policy",
    "old_hidden": "[B, T, H] final hidden states of the sampling policy at the positions predicting each token",
    "hidden": "[B, T, H] the current policy's final hidden states at the same positions",
    "lm_head_weight": "[V, H] the output projection",
    "temperature": "float, the sampling temperature the log-probs use",
    "entropy": "[B, T] the current policy's entropy at each token's position, with its gradient",
}


# ----------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_size: int,
    *,
    std: str = "group",
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Advantages [N] for rewards [N] laid out prompt-major (the G samples of a prompt are adjacent).

    A = (r - baseline) / (std + eps). baseline: the group mean, or with leave_one_out the mean of the
    other G-1 samples. std: "group" (GRPO), "batch" (one std over all N) or "none" (Dr. GRPO).
    """
    device = rewards.device if isinstance(rewards, Tensor) else "cpu"  # stay where the rewards are
    r = torch.as_tensor(rewards, dtype=torch.float64, device=device)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    if group_size < 2 or r.numel() % group_size:
        raise ValueError(f"group_size={group_size} must be >= 2 and divide the {r.numel()} rewards")
    if std not in ADV_STDS:
        raise ValueError(f"std must be 'group', 'batch' or 'none', got {std!r}")
    groups = r.view(-1, group_size)  # [N/G, G]
    others_mean = (groups.sum(1, keepdim=True) - groups) / (group_size - 1)
    baseline = others_mean if leave_one_out else groups.mean(1, keepdim=True)
    # A mean of equal floats can be off by an ulp, and that ulp over a ~0 std would be +-1: force zero.
    all_equal = groups.amax(1, keepdim=True) == groups.amin(1, keepdim=True)
    advantages = torch.where(all_equal, 0.0, groups - baseline)
    if std == "group":
        advantages = advantages / (groups.std(1, keepdim=True) + eps)
    elif std == "batch":
        advantages = advantages / (r.std() + eps)
    return advantages.flatten().float()


def advantages(rewards: Tensor | Sequence[float], group_size: int, cfg: LossConfig) -> Tensor:
    """Advantages [N] with the config's options: cfg.adv_std and cfg.leave_one_out."""
    return group_advantages(rewards, group_size, std=cfg.adv_std, leave_one_out=cfg.leave_one_out)


# ----------------------------------------------------------------------------- the clip operator


class Clip(NamedTuple):
    """What the clip operator did to each token, all [B, T]; the three flags never overlap."""

    ratio: Tensor  # w, with its gradient stopped where the operator stops it
    low: Tensor  # bool: stopped below the rule's region
    high: Tensor  # bool: stopped above the rule's region
    limit: Tensor  # bool: stopped by ratio_limits or dual_clip while inside the region


def trust_region_clip(
    ratio: Tensor,
    inside: Tensor,
    advantages: Tensor,
    *,
    limits: tuple[float, float] | None = None,
    dual_clip: float | tuple[float, float] | None = None,
) -> Clip:
    """PPO's min(w*A, clip(w)*A) for any region: w where the token may move, stop-gradient w where not.

    clip(w) is w moved to the region's edge, a constant. Inside the region the two terms are equal.
    Outside, the min takes clip(w)*A exactly when the advantage pushes w further out, A*(w-1) > 0:
    that token loses its gradient; one that the advantage pulls back in keeps w*A and its gradient.
    Written as that choice the operator needs no edge, so regions without a closed-form edge work
    the same way; a stopped token keeps the value w*A rather than edge*A (same gradient, test_loss
    checks it against the textbook min).
    limits (lo, hi), cfg.ratio_limits, intersect the region with [lo, hi] under the same choice.
    dual_clip c also stops tokens with A < 0 and w > c, which the region pulls back in (and, given as
    (lo, c), tokens with A > 0 and w < lo): it caps how far a bad token's loss may grow.
    """
    w = ratio.detach()
    outward = advantages * (w - 1) > 0
    region = ~inside & outward
    limit = torch.zeros_like(region)
    if limits is not None:
        limit = inside & outward & ((w < limits[0]) | (w > limits[1]))
    if dual_clip is not None:
        lo, hi = _dual_bounds(dual_clip)
        limit = limit | ((advantages < 0) & (w > hi)) | ((advantages > 0) & (w < lo))
    return Clip(torch.where(region | limit, w, ratio), region & (w < 1), region & (w > 1), limit)


def _dual_bounds(dual_clip: float | tuple[float, float]) -> tuple[float, float]:
    """(lo, hi) of a dual clip given as c (lo = 0: no lower edge) or as a pair (lo, hi)."""
    if isinstance(dual_clip, (int, float)):
        return 0.0, float(dual_clip)
    return float(dual_clip[0]), float(dual_clip[1])


# ----------------------------------------------------------------------------- the configuration


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
            "help": "clip rule: a name from loss.py's table (grpo, dapo, atr, interval, ...) or a GPPO cell "
            "divergence-estimator (kl-atomic, tv-binary, ...)"
        },
    )
    delta: float | None = field(
        default=None, metadata={"help": "trust-region size d; empty = the rule's default (grid cells: f(0.8))"}
    )
    delta_high: float | None = field(
        default=None,
        metadata={
            "help": "upper size of asymmetric rules (dapo, dcpo, gspo, gmpo); empty = delta times the rule's ratio"
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
        if self.delta is None and isinstance(self.rule, tuple):  # f(0.8), GRPO's lower edge, in these conventions
            log_08 = torch.tensor(math.log(0.8), dtype=torch.float64)
            self.delta = round(DIVERGENCES[self.rule[0]](log_08, self).item(), 12)  # round off float noise
        elif self.delta is None:
            self.delta = rule.delta
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
        ):
            if not ok:
                raise _invalid(name, getattr(self, name), why)


def _valid_dual_clip(dual_clip) -> bool:
    if isinstance(dual_clip, (int, float)):
        return dual_clip > 1
    return len(dual_clip) == 2 and 0 < dual_clip[0] < 1 < dual_clip[1]


def required_inputs(cfg: LossConfig) -> frozenset[str]:
    """The names policy_loss needs beyond the log-probs: the rule's declared needs, ref_logp for a KL penalty,
    and the differentiable entropy for an entropy bonus."""
    return (
        frozenset(get_rule(cfg.rule).needs)
        | ({"ref_logp"} if cfg.kl_beta > 0 else set())
        | ({"entropy"} if cfg.entropy_coef > 0 else set())
    )


# ----------------------------------------------------------------------------- the rule interface


@dataclass(frozen=True)
class Tokens:
    """What an objective receives: one micro-batch of completion tokens, tensors [B, T]."""

    logp: Tensor  # the current policy's log-probs; the gradient flows through them
    log_ratio: Tensor  # log w = logp - old_logp, clamped to +-LOG_RATIO_CAP, 0 off the mask (with gradient)
    old_logp: Tensor  # the sampling policy's, constant
    adv: Tensor  # advantages broadcast to [B, T], constant
    mask: Tensor  # bool, True on completion tokens
    inputs: dict  # the rule's declared needs by name (see INPUTS)
    cfg: LossConfig
    rule: Rule

    def inside(self, log_w: Tensor) -> Tensor:
        """The rule's region at these ratios, bool [B, T], evaluated in float64 (see Rule)."""
        return inside(self.rule, log_w.detach().double(), self.old_logp.double(), self.cfg)

    def clip(self, log_w: Tensor, inside: Tensor | None = None) -> Clip:
        """The clip operator at ratios exp(log_w), with the rule's region or the given `inside`."""
        inside = self.inside(log_w) if inside is None else inside
        return trust_region_clip(
            log_w.exp(), inside, self.adv, limits=self.cfg.ratio_limits, dual_clip=self.cfg.dual_clip
        )


Objective = Callable[[Tokens], tuple[Tensor, Clip]]


@dataclass(frozen=True)
class Rule:
    """One entry of the catalogue: how its region enters the loss, the region itself, its defaults.

    objective(tokens) -> (objective [B, T], clip): the per-token objective to maximize (policy_loss
    negates it, adds the KL penalty and aggregates; its gradient is the policy gradient), and the Clip
    whose flags the metrics and per-token records count.
    A hard region is given one or two ways. region(log_w, old_logp, cfg) -> inside, bool, on float64
    tensors, tests w directly; bounds(mu, cfg) -> (lo, hi) is its closed-form interval. Training
    tests region when there is one, else bounds; ratio_bounds uses bounds when there is one, else
    bisects region (the two agree where both exist, and the tests check it). With neither, the rule
    is soft: every token is inside. A rule whose region needs more than (w, mu) decides it in its
    objective from `needs`; its region is then the (w, mu) outer bound that ratio_bounds reports.
    needs: the names from INPUTS the objective reads; the trainer passes them to policy_loss.
    aggregation: set for sequence-level rules, which are defined with it (LossConfig refuses another).
    """

    objective: Objective
    region: Callable | None = None
    bounds: Callable | None = None
    delta: float | None = None  # soft rules (and interval) have no size
    delta_high: float | None = None
    needs: tuple[str, ...] = ()
    aggregation: str | None = None


def inside(rule: Rule, log_w: Tensor, old_logp: Tensor, cfg: LossConfig) -> Tensor:
    """Whether each token's ratio (log w, at its old log-probability) is inside the rule's region."""
    if rule.region is not None:
        return rule.region(log_w, old_logp, cfg)
    if rule.bounds is not None:
        lo, hi = rule.bounds(old_logp.exp(), cfg)
        return (log_w.exp() >= lo) & (log_w.exp() <= hi)
    return torch.ones_like(log_w, dtype=torch.bool)


# ----------------------------------------------------------------------------- the loss


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
    objective, clip = rule.objective(Tokens(logp, log_ratio, old_logp, adv, mask, inputs, cfg, rule))
    token_loss, ref_kl = -objective, None
    if cfg.kl_beta:
        ref_kl = _reference_kl(logp, inputs["ref_logp"].detach(), cfg.kl_estimator)
        token_loss = token_loss + cfg.kl_beta * ref_kl
    if cfg.entropy_coef:
        token_loss = token_loss - cfg.entropy_coef * inputs["entropy"]
    loss = _aggregate(token_loss, mask, cfg, num_tokens, num_seqs)
    if records is not None:
        records.append(_token_record(old_logp, adv, mask, clip))
    return loss, _metrics(log_ratio, old_logp, adv, mask, clip, ref_kl)


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
    each is over (*_tokens). clip_low_frac and the other *_frac keep the older count over every token."""
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
        "w": column(clip.ratio.detach(), torch.float32),
        "advantage": column(adv, torch.float32),
        "region_low": column(clip.low, torch.bool),
        "region_high": column(clip.high, torch.bool),
        "limit": column(clip.limit, torch.bool),
    }


# ----------------------------------------------------------------------------- the rules: objectives


def _ppo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    clip = t.clip(t.log_ratio)
    return t.adv * clip.ratio, clip


def _gspo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Every token carries the sequence ratio s = exp(mean log w) as value and s * grad log pi_t as
    # gradient; averaged over the sequence that is exactly GSPO's A * grad s.
    lengths = t.mask.sum(-1, keepdim=True).clamp_min(1)
    seq_log_ratio = torch.where(t.mask, t.log_ratio, 0).sum(-1, keepdim=True) / lengths  # [B, 1]
    clip = t.clip(seq_log_ratio.detach() + t.log_ratio - t.log_ratio.detach())  # [B, T]
    return t.adv * clip.ratio, clip


def _gmpo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Clip each log w like PPO (stopped tokens sit at the edge of the region and the limits), then
    # take the geometric mean.
    clip, cfg = t.clip(t.log_ratio), t.cfg
    lo, hi = -cfg.delta, cfg.delta_high
    if cfg.ratio_limits is not None:
        limit_lo, limit_hi = cfg.ratio_limits
        lo, hi = max(lo, math.log(limit_lo) if limit_lo > 0 else -math.inf), min(hi, math.log(limit_hi))
    edge = t.log_ratio.detach().clamp(lo, hi)
    stopped = clip.low | clip.high | clip.limit
    clipped_log_ratio = torch.where(stopped & t.mask, edge, torch.where(t.mask, t.log_ratio, 0))
    lengths = t.mask.sum(-1).clamp_min(1)
    seq_ratio = (clipped_log_ratio.sum(-1) / lengths).exp()  # [B]
    seq_adv = torch.where(t.mask, t.adv, 0).sum(-1) / lengths  # [B]
    return (seq_adv * seq_ratio)[:, None].expand_as(t.log_ratio), clip


def _cispo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # w * sg(weight / w) has value `weight` and gradient weight * grad log pi: REINFORCE with a
    # truncated, stop-gradient importance weight, so the region never takes a token's gradient.
    # Its flags: `high` marks the truncated weights.
    clip = t.clip(t.log_ratio, inside=torch.ones_like(t.mask))
    truncated = ~t.inside(t.log_ratio)
    weight = torch.where(truncated, 1 + t.cfg.delta, clip.ratio.detach())
    objective = t.adv * clip.ratio * (weight / clip.ratio.detach())
    return objective, clip._replace(high=truncated, limit=clip.limit & ~truncated)


def _sapo_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # d/dw of (4/tau) sigmoid(tau (w-1)) is 4 s (1-s), which is 1 at w = 1 and fades smoothly.
    clip = t.clip(t.log_ratio)
    tau = torch.where(t.adv > 0, t.cfg.sapo_tau_pos, t.cfg.sapo_tau_neg)
    return t.adv * 4 / tau * torch.sigmoid(tau * (clip.ratio - 1)), clip


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


def _clip_cov_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Entropy collapse is driven by tokens with high cov(A, log pi); stop a random few of them.
    clip = t.clip(t.log_ratio)
    cov = _token_covariance(t.logp, t.adv, t.mask)
    low, high = t.cfg.clip_cov_bounds
    candidate = ~(clip.low | clip.high | clip.limit) & (cov > low) & (cov < high)
    random_key = torch.where(candidate, torch.rand_like(cov), -math.inf)  # global RNG: seeded by the trainer
    picked = _top_tokens(random_key, max(1, int(t.cfg.cov_ratio * t.mask.sum())))
    below = clip.ratio.detach() < 1
    return (
        t.adv * torch.where(picked, clip.ratio.detach(), clip.ratio),
        clip._replace(low=clip.low | (picked & below), high=clip.high | (picked & ~below)),
    )


def _kl_cov_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # Rather than stop the highest-covariance tokens, tie them to the old policy with |log w|.
    clip = t.clip(t.log_ratio)
    picked = _top_tokens(_token_covariance(t.logp, t.adv, t.mask), max(1, int(t.cfg.cov_ratio * t.mask.sum())))
    return t.adv * clip.ratio - t.cfg.kl_cov_coef * picked * t.log_ratio.abs(), clip


def _kl_full_objective(t: Tokens) -> tuple[Tensor, Clip]:
    # The one region that depends on more than the sampled token: the exact KL over the vocabulary
    # between the sampling and the current policy, a constant for the region test.
    x = t.inputs
    vocab_kl = full_vocab_kl(x["old_hidden"], x["hidden"], x["lm_head_weight"], temperature=x["temperature"])
    clip = t.clip(t.log_ratio, inside=vocab_kl <= t.cfg.delta)
    return t.adv * clip.ratio, clip


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


# ----------------------------------------------------------------------------- the rules: regions


def _constant_bounds(mu: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    return torch.full_like(mu, lo), torch.full_like(mu, hi)


def _interval_bounds(mu, cfg):  # grpo, dapo, gspo, clip_cov
    return _constant_bounds(mu, max(1 - cfg.delta, 0.0), 1 + cfg.delta_high)


def _everywhere_bounds(mu, cfg):  # interval: only ratio_limits clip
    return _constant_bounds(mu, 0.0, math.inf)


def _cispo_bounds(mu, cfg):  # where the importance weight is not truncated
    return _constant_bounds(mu, 0.0, 1 + cfg.delta)


def _gmpo_bounds(mu, cfg):  # GMPO clips log w to [-d, d_high]
    return _constant_bounds(mu, math.exp(-cfg.delta), math.exp(cfg.delta_high))


def _kl1_bounds(mu, cfg):
    return _constant_bounds(mu, math.exp(-cfg.delta), math.inf)


def _kl2_bounds(mu, cfg):
    edge = math.sqrt(2 * cfg.delta)
    return _constant_bounds(mu, math.exp(-edge), math.exp(edge))


def _dppo_bounds(mu, cfg):
    # DPPO's binary TV |pi - mu| = mu*|w - 1| <= d: the ratio may move by d/mu, so rare tokens move far
    return (1 - cfg.delta / mu).clamp_min(0), 1 + cfg.delta / mu


def _dcpo_bounds(mu, cfg):
    # Roots of mu*w*(1-w) = d and mu*w*(w-1) = d_high: the allowed change of the token's probability
    # shrinks as mu grows, so rare tokens may move further.
    lo = 0.5 + 0.5 * torch.sqrt((1 - 4 * cfg.delta / mu).clamp_min(0))
    hi = 0.5 + 0.5 * torch.sqrt(1 + 4 * cfg.delta_high / mu)
    return lo, hi.clamp_max(DCPO_MAX_RATIO)


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


def _kl3_bounds(mu, cfg):
    # w - 1 - log w = d  <=>  (-w) e^(-w) = -e^(-1-d), so -w = W(-e^(-1-d)) on either real branch.
    x = torch.full_like(mu, -math.exp(-1 - cfg.delta))
    return -_lambertw(x, 0), -_lambertw(x, -1)


def _sampled_kl_region(estimate: Callable[[Tensor], Tensor]) -> Callable:
    return lambda log_w, old_logp, cfg: estimate(log_w) <= cfg.delta


DIVERGENCES: dict[str, Callable[[Tensor, LossConfig], Tensor]] = {  # f as a function of log w
    "tv": lambda lw, cfg: torch.expm1(lw).abs() * (0.5 if cfg.tv_half else 1.0),
    "chi2": lambda lw, cfg: torch.expm1(lw) ** 2,
    "hellinger": lambda lw, cfg: torch.expm1(lw / 2) ** 2,
    "kl": lambda lw, cfg: lw.abs() if cfg.kl_two_sided else -lw,
}
ESTIMATORS = ("mc", "atomic", "binary")


def grid_distance(divergence: str, estimator: str, log_w: Tensor, old_logp: Tensor, cfg: LossConfig) -> Tensor:
    """The GPPO grid's estimate of the divergence between old and new policy at one token (float64)."""
    f = DIVERGENCES[divergence]
    if estimator == "mc":
        return f(log_w, cfg)
    mu = old_logp.exp()
    if estimator == "atomic":
        return mu * f(log_w, cfg)
    # binary: the two-outcome distributions {token, rest}; the rest holds 1-mu before, 1-mu*w after.
    rest_old = (-torch.expm1(old_logp)).clamp_min(1e-300)
    rest_new = -torch.expm1(old_logp + log_w)
    distance = mu * f(log_w, cfg) + rest_old * f(torch.log(rest_new.clamp_min(0)) - torch.log(rest_old), cfg)
    return torch.where(rest_new < 0, math.inf, distance)  # mu*w > 1 is no distribution


def _bernoulli_kl_region(log_w, old_logp, cfg):
    return grid_distance("kl", "binary", log_w, old_logp, dataclasses.replace(cfg, kl_two_sided=False)) <= cfg.delta


_KL3 = Rule(_ppo_objective, _sampled_kl_region(lambda lw: torch.expm1(lw) - lw), _kl3_bounds, delta=0.07)
SEQUENCE_MEAN = "seq-mean-token-mean"
RULES: dict[str, Rule] = {  # the registry: add a rule here
    "grpo": Rule(_ppo_objective, bounds=_interval_bounds, delta=0.2),
    "dapo": Rule(_ppo_objective, bounds=_interval_bounds, delta=0.2, delta_high=0.28),
    "interval": Rule(_ppo_objective, bounds=_everywhere_bounds),
    "kl1": Rule(_ppo_objective, _sampled_kl_region(lambda lw: -lw), _kl1_bounds, delta=-math.log(0.8)),
    "kl2": Rule(_ppo_objective, _sampled_kl_region(lambda lw: lw**2 / 2), _kl2_bounds, delta=math.log(0.8) ** 2 / 2),
    "kl3": _KL3,
    "atr": _KL3,
    "kl_full": Rule(
        _kl_full_objective,
        _bernoulli_kl_region,
        delta=0.07,
        needs=("old_hidden", "hidden", "lm_head_weight", "temperature"),
    ),
    "dcpo": Rule(_ppo_objective, bounds=_dcpo_bounds, delta=0.2, delta_high=0.28),
    "dppo": Rule(_ppo_objective, bounds=_dppo_bounds, delta=0.2),
    "gspo": Rule(_gspo_objective, bounds=_interval_bounds, delta=3e-4, delta_high=4e-4, aggregation=SEQUENCE_MEAN),
    "gmpo": Rule(_gmpo_objective, bounds=_gmpo_bounds, delta=0.4, aggregation=SEQUENCE_MEAN),
    "cispo": Rule(_cispo_objective, bounds=_cispo_bounds, delta=0.2),
    "sapo": Rule(_sapo_objective, aggregation=SEQUENCE_MEAN),
    "clip_cov": Rule(_clip_cov_objective, bounds=_interval_bounds, delta=0.2),
    "kl_cov": Rule(_kl_cov_objective),
}


def get_rule(rule: str | tuple[str, str]) -> Rule:
    """The Rule registered under a name, or the GPPO grid rule for (divergence, estimator)."""
    if isinstance(rule, tuple):
        if len(rule) != 2 or rule[0] not in DIVERGENCES or rule[1] not in ESTIMATORS:
            raise ValueError(f"rule {rule!r}: expected (divergence, estimator) in {tuple(DIVERGENCES)} x {ESTIMATORS}")
        return Rule(_ppo_objective, lambda lw, old, cfg: grid_distance(*rule, lw, old, cfg) <= cfg.delta)
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}, or (divergence, estimator)")
    return RULES[rule]


def inert_settings(cfg: LossConfig) -> dict[str, str]:
    """The fields that change nothing with this rule and aggregation, each with the reason: a flag given
    for one of them can only be a mistake (config.check_given refuses it)."""
    name, rule = cfg.rule, get_rule(cfg.rule)
    shown = "-".join(name) if isinstance(name, tuple) else name
    divergence = name[0] if isinstance(name, tuple) else None
    inert = {}
    if rule.delta is None and divergence is None:
        inert["delta"] = f"--rule {shown} has no trust-region size"
    if rule.bounds not in (_interval_bounds, _gmpo_bounds, _dcpo_bounds):
        inert["delta_high"] = (
            f"--rule {shown} has no separate upper size (grpo, dapo, dcpo, gspo, gmpo and clip_cov do)"
        )
    for field_name, owner in (("tv_half", "tv"), ("kl_two_sided", "kl")):
        if divergence != owner:
            inert[field_name] = f"only the {owner} cells of the GPPO grid read it, not --rule {shown}"
    for field_name, owners in (
        ("sapo_tau_pos", ("sapo",)),
        ("sapo_tau_neg", ("sapo",)),
        ("cov_ratio", ("clip_cov", "kl_cov")),
        ("clip_cov_bounds", ("clip_cov",)),
        ("kl_cov_coef", ("kl_cov",)),
    ):
        if name not in owners:
            inert[field_name] = f"only --rule {' or '.join(owners)} reads it, not --rule {shown}"
    if cfg.aggregation != "seq-mean-token-sum-norm":
        inert["norm_len"] = f"only --aggregation seq-mean-token-sum-norm divides by it, not {cfg.aggregation}"
    if cfg.kl_beta == 0:
        inert["kl_estimator"] = "the KL penalty is off (--kl-beta 0)"
    return inert


# ----------------------------------------------------------------------------- intervals


def as_probabilities(name: str, x) -> Tensor:
    """x as float64 probabilities in (0, 1]; a ValueError naming it otherwise."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if not ((x > 0) & (x <= 1)).all():
        raise ValueError(f"{name} must be probabilities in (0, 1]")
    return x


def ratio_bounds(rule: str | tuple[str, str], delta: float | None, mu, **options) -> tuple[Tensor, Tensor]:
    """The ratio interval [lo, hi] a rule admits at old probability mu (float or tensor), float64.

    Closed forms where they exist; otherwise bisection on log w (64 steps, vectorized over mu).
    An unbounded side is 0 or inf. options: other LossConfig fields (delta_high, tv_half,
    kl_two_sided, ratio_limits: the interval is then intersected with the limits).
    """
    cfg = LossConfig(rule=rule, delta=delta, **options)
    spec = get_rule(cfg.rule)
    mu = as_probabilities("mu", mu)
    if spec.bounds is not None:
        lo, hi = (bound.expand_as(mu) for bound in spec.bounds(mu, cfg))
    elif spec.region is None:
        raise ValueError(f"rule {rule!r} has no trust region, so no ratio interval")
    else:
        old_logp = mu.log()

        def edge(direction: float) -> Tensor:  # every region is an interval in log w around 0
            inner, outer = torch.zeros_like(mu), torch.full_like(mu, direction * SEARCH_CAP)
            unbounded = spec.region(outer, old_logp, cfg)
            for _ in range(64):
                middle = (inner + outer) / 2
                ok = spec.region(middle, old_logp, cfg)
                inner, outer = torch.where(ok, middle, inner), torch.where(ok, outer, middle)
            return torch.where(unbounded, math.exp(direction * math.inf), inner.exp())

        lo, hi = edge(-1.0), edge(1.0)
    if cfg.ratio_limits is not None:
        lo, hi = lo.clamp_min(cfg.ratio_limits[0]), hi.clamp_max(cfg.ratio_limits[1])
    return lo, hi
