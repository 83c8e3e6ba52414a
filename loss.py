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
kl1           -log w <= d (one-sided by construction)                  KL1(0.8)=.223 [0.8, inf)      same
kl2           log^2(w)/2 <= d; bounds exp(-+sqrt(2d))                  KL2(0.8)=.025 [0.8, 1.25]     same
kl3, atr      w - 1 - log w <= d; bounds by Lambert W (ATR-GRPO)       0.07          [0.671, 1.422]  same
kl_full       exact KL(old || new) over the vocabulary <= d (*)        0.07          [0.639, 1.361]  [0.103, 3.47]
dcpo          mu*w*(1-w) <= d, w >= 1/2 below 1; mu*w*(w-1) <= d_high, 0.2, 0.28     [0.5, 1.4]      [0.5, 2.92]
              w <= 10 above (DCPO: rare tokens may move further)
(f, est)      the GPPO grid below, e.g. ("kl", "atomic") or "kl-atomic"  f(0.8)
gspo          1-d <= s <= 1+d_high on the sequence ratio               3e-4, 4e-4    [.9997, 1.0004] same
              s = exp(mean log w) (GSPO; use seq-mean-token-mean)
gmpo          |log w| <= d per token, loss A * geometric mean of the   0.4           [0.670, 1.492]  same
              clipped ratios (GMPO; use seq-mean-token-mean)
cispo         soft: gradient sg(min(w, 1+d)) * A * grad log pi for     0.2           [0, 1.2]        same
              every token; the interval is where w is not truncated (CISPO)
sapo          soft: A * (4/tau) sigmoid(tau (w-1)), tau 1.0 for A > 0, 1.05 for A < 0; weight 1 at w = 1 (SAPO)
clip_cov      grpo's region, and a random cov_ratio = 2e-4 of tokens   0.2           [0.8, 1.2]      same
              with cov(A, logp) in (1, 5) also lose their gradient
kl_cov        no clip; the top 2e-4 of tokens by cov(A, logp) add 1.0 * |log w| to their loss
(*) The region depends on the whole distribution; its interval is the tight outer bound
    KL(Bernoulli(mu) || Bernoulli(mu*w)) <= d. d = ATR's, as k3 estimates this KL without bias.

The GPPO grid: divergence f (tv |w-1|, chi2 (w-1)^2, hellinger (sqrt(w)-1)^2, kl |log w|) times an
estimator: mc f(w) <= d; atomic mu*f(w) <= d; binary mu*f(w) + (1-mu)*f((1-mu*w)/(1-mu)) <= d, the
divergence between the two-outcome distributions {token, rest}. GRPO = (tv, mc), DAPO-like = (kl, mc),
DPPO = (tv, binary), RIPO = (chi2, atomic). Default d = f(0.8), GRPO's lower edge: tv 0.2, chi2 0.04,
hellinger 0.0111, kl 0.223. At mu = 0.5 / 0.05: (kl, mc) [0.8, 1.25] / same; (tv, binary) [0.8, 1.2] /
[0, 3]; (chi2, atomic) [0.717, 1.283] / [0.106, 1.894]; (kl, atomic) [0.640, 1.562] / [0.012, 86.7].
Conventions, where papers differ: TV is |w-1| without the 1/2 (tv_half=True halves it); the kl region
is two-sided, |log w| <= d (kl_two_sided=False uses -log w: mc and atomic then bound only decreases,
and (kl, binary) becomes the exact Bernoulli KL).

Numerics: log w is clamped to [-20, 20] before exp (e^20 ~ 5e8 is outside every bounded region),
regions are evaluated in float64 on log w, and groups with equal rewards get exactly zero advantage.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

LOG_RATIO_CAP = 20.0  # |log w| beyond this is held constant (no gradient): no bounded region reaches it
SEARCH_CAP = 700.0  # ratio_bounds searches log w in [-700, 700]; e^700 ~ 1e304 still fits float64
DCPO_MAX_RATIO = 10.0  # DCPO caps its dynamic upper bound here
MU_EDGES = (0.01, 0.1, 0.5, 0.9)  # old-probability buckets for the diagnostics
MU_LABELS = ("<0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", ">0.9")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------- advantages


def group_advantages(rewards: Tensor | Sequence[float], group_size: int, *, std: str = "group",
                     leave_one_out: bool = False, eps: float = 1e-6) -> Tensor:
    """Advantages [N] for rewards [N] laid out prompt-major (the G samples of a prompt are adjacent).

    A = (r - baseline) / (std + eps). baseline: the group mean, or with leave_one_out the mean of the
    other G-1 samples. std: "group" (GRPO), "batch" (one std over all N) or "none" (Dr. GRPO).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    if group_size < 2 or r.numel() % group_size:
        raise ValueError(f"group_size={group_size} must be >= 2 and divide the {r.numel()} rewards")
    if std not in ("group", "batch", "none"):
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


# ----------------------------------------------------------------------------- rules


@dataclass
class LossConfig:
    """Everything policy_loss needs; fields left None take the rule's defaults from the table above."""

    rule: str | tuple[str, str] = "grpo"  # a name from the table, or (divergence, estimator), or "kl-atomic"
    delta: float | None = None  # trust-region size
    delta_high: float | None = None  # upper size of asymmetric rules; None: delta times the rule's ratio
    # dual clip, c > 1: tokens with A < 0 and w > c lose their gradient (3.0 typical). A pair (lo, hi)
    # also stops tokens with A > 0 and w < lo, its mirror image (GPPO's [0.5, 10]).
    dual_clip: float | tuple[float, float] | None = None
    aggregation: str = "token-mean"  # see AGGREGATIONS and policy_loss
    norm_len: int | None = None  # seq-mean-token-sum-norm's constant; None: the batch's T
    kl_beta: float = 0.0  # weight of the KL penalty to a reference policy
    kl_estimator: str = "k3"  # k1 log(pi/ref), k2 log^2(pi/ref)/2, k3 ref/pi - 1 - log(ref/pi)
    tv_half: bool = False  # TV = |w-1|/2 instead of |w-1|
    kl_two_sided: bool = True  # kl divergence |log w| instead of -log w
    sapo_tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # ... and for A < 0 (sharper: negative updates fade faster)
    cov_ratio: float = 2e-4  # clip_cov / kl_cov: fraction of tokens selected by covariance
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)  # clip_cov: covariance window to sample from
    kl_cov_coef: float = 1.0  # kl_cov: weight of |log w| on the selected tokens

    def __post_init__(self):
        if isinstance(self.rule, str) and self.rule.split("-")[0] in DIVERGENCES:
            self.rule = tuple(self.rule.split("-", 1))  # "kl-atomic", as a command line spells it
        elif isinstance(self.rule, list):
            self.rule = tuple(self.rule)
        rule = get_rule(self.rule)
        if self.delta is None and isinstance(self.rule, tuple):  # f(0.8), GRPO's lower edge, in these conventions
            log_08 = torch.tensor(math.log(0.8), dtype=torch.float64)
            self.delta = round(DIVERGENCES[self.rule[0]](log_08, self).item(), 12)  # round off float noise
        elif self.delta is None:
            self.delta = rule.delta
        if self.delta_high is None and self.delta is not None:
            self.delta_high = self.delta * (rule.delta_high / rule.delta if rule.delta_high else 1.0)
        for ok, message in (
            (self.delta is None or self.delta >= 0, f"delta must be >= 0, got {self.delta}"),
            (self.delta_high is None or self.delta_high >= 0, f"delta_high must be >= 0, got {self.delta_high}"),
            (self.dual_clip is None or _valid_dual_clip(self.dual_clip),
             f"dual_clip must be c > 1 or (lo, hi) with 0 < lo < 1 < hi, got {self.dual_clip}"),
            (self.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"),
            (self.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be k1, k2 or k3, got {self.kl_estimator!r}"),
            (self.norm_len is None or self.norm_len >= 1, f"norm_len must be >= 1, got {self.norm_len}"),
            (0 < self.cov_ratio <= 1, f"cov_ratio must be in (0, 1], got {self.cov_ratio}"),
            (min(self.sapo_tau_pos, self.sapo_tau_neg) > 0, "sapo_tau_pos and sapo_tau_neg must be > 0"),
        ):
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Rule:
    """A clip rule: how its region enters the loss, the region itself, and the published defaults."""

    objective: Callable  # (logp, log_ratio, adv, mask, cfg, inside_of) -> (objective, clipped), all [B, T]
    region: Callable | None = None  # (log w, old_logp, cfg), float64 -> inside, bool; tested on w directly
    bounds: Callable | None = None  # (mu, cfg) -> (lo, hi): the closed-form interval, if there is one
    delta: float | None = None  # soft rules (neither region nor bounds) keep every token inside
    delta_high: float | None = None


def _valid_dual_clip(dual_clip) -> bool:
    if isinstance(dual_clip, (int, float)):
        return dual_clip > 1
    return len(dual_clip) == 2 and 0 < dual_clip[0] < 1 < dual_clip[1]


def _dual_bounds(dual_clip: float | tuple[float, float]) -> tuple[float, float]:
    """(lo, hi) of a dual clip given as c (lo = 0: no lower edge) or as a pair (lo, hi)."""
    if isinstance(dual_clip, (int, float)):
        return 0.0, float(dual_clip)
    lo, hi = dual_clip
    return float(lo), float(hi)


def trust_region_clip(ratio: Tensor, inside: Tensor, advantages: Tensor,
                      dual_clip: float | tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
    """The clip operator every hard region shares: w where it may move, stop-gradient w where not.

    PPO maximizes min(w*A, clip(w)*A). With a stop-gradient outside value the two arguments tie, so
    the min is written out as the choice it makes: a token outside the region whose advantage pushes
    it further out (A*(w-1) > 0) keeps its value but loses its gradient; every other token keeps its
    gradient A*w. Dual clip also stops tokens with A < 0 and w > c, capping their loss growth (and,
    given as (lo, c), tokens with A > 0 and w < lo).
    Returns (ratio [B, T] with those gradients stopped, clipped [B, T] int8: +1 stopped above the
    region, -1 below, 0 free).
    """
    w = ratio.detach()
    stopped = ~inside & (advantages * (w - 1) > 0)
    if dual_clip is not None:
        lo, hi = _dual_bounds(dual_clip)
        stopped = stopped | ((advantages < 0) & (w > hi)) | ((advantages > 0) & (w < lo))
    return torch.where(stopped, w, ratio), (torch.sign(w - 1) * stopped).to(torch.int8)


def _ppo_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    ratio, clipped = trust_region_clip(log_ratio.exp(), inside_of(log_ratio), adv, cfg.dual_clip)
    return adv * ratio, clipped


def _gspo_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    # Every token carries the sequence ratio s = exp(mean log w) as value and s * grad log pi_t as
    # gradient; averaged over the sequence that is exactly GSPO's A * grad s.
    lengths = mask.sum(-1, keepdim=True).clamp_min(1)
    seq_log_ratio = torch.where(mask, log_ratio, 0).sum(-1, keepdim=True) / lengths  # [B, 1]
    token_log_s = seq_log_ratio.detach() + log_ratio - log_ratio.detach()  # [B, T]
    return _ppo_objective(logp, token_log_s, adv, mask, cfg, inside_of)


def _gmpo_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    # Clip each log w like PPO (stopped tokens sit at the region's edge), then take the geometric mean.
    _, clipped = trust_region_clip(log_ratio.exp(), inside_of(log_ratio), adv, cfg.dual_clip)
    edge = log_ratio.detach().clamp(-cfg.delta, cfg.delta_high)
    clipped_log_ratio = torch.where((clipped != 0) & mask, edge, torch.where(mask, log_ratio, 0))
    lengths = mask.sum(-1).clamp_min(1)
    seq_ratio = (clipped_log_ratio.sum(-1) / lengths).exp()  # [B]
    seq_adv = torch.where(mask, adv, 0).sum(-1) / lengths  # [B]
    return (seq_adv * seq_ratio)[:, None].expand_as(log_ratio), clipped


def _cispo_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    # w * sg(weight / w) has value `weight` and gradient weight * grad log pi: REINFORCE with a
    # truncated, stop-gradient importance weight, so no token ever loses its gradient to the clip.
    ratio, clipped = trust_region_clip(log_ratio.exp(), torch.ones_like(mask), adv, cfg.dual_clip)
    truncated = ~inside_of(log_ratio)
    weight = torch.where(truncated, 1 + cfg.delta, ratio.detach())
    return adv * ratio * (weight / ratio.detach()), torch.where(truncated, 1, clipped)


def _sapo_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    # d/dw of (4/tau) sigmoid(tau (w-1)) is 4 s (1-s), which is 1 at w = 1 and fades smoothly.
    ratio, clipped = trust_region_clip(log_ratio.exp(), inside_of(log_ratio), adv, cfg.dual_clip)
    tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return adv * 4 / tau * torch.sigmoid(tau * (ratio - 1)), clipped


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
    picked[top.indices] = top.values > -math.inf
    return picked.view_as(score)


def _clip_cov_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    # Entropy collapse is driven by tokens with high cov(A, log pi); stop a random few of them.
    ratio, clipped = trust_region_clip(log_ratio.exp(), inside_of(log_ratio), adv, cfg.dual_clip)
    cov = _token_covariance(logp, adv, mask)
    low, high = cfg.clip_cov_bounds
    candidate = (clipped == 0) & (cov > low) & (cov < high)
    random_key = torch.where(candidate, torch.rand_like(cov), -math.inf)  # global RNG: seeded by the trainer
    picked = _top_tokens(random_key, max(1, int(cfg.cov_ratio * mask.sum())))
    side = torch.where(ratio.detach() < 1, -1, 1).to(torch.int8)
    return adv * torch.where(picked, ratio.detach(), ratio), torch.where(picked, side, clipped)


def _kl_cov_objective(logp, log_ratio, adv, mask, cfg, inside_of):
    # Rather than stop the highest-covariance tokens, tie them to the old policy with |log w|.
    ratio, clipped = trust_region_clip(log_ratio.exp(), inside_of(log_ratio), adv, cfg.dual_clip)
    picked = _top_tokens(_token_covariance(logp, adv, mask), max(1, int(cfg.cov_ratio * mask.sum())))
    return adv * ratio - cfg.kl_cov_coef * picked * log_ratio.abs(), clipped


def _constant_bounds(mu: Tensor, lo: float, hi: float) -> tuple[Tensor, Tensor]:
    return torch.full_like(mu, lo), torch.full_like(mu, hi)


def _interval_bounds(mu, cfg):  # grpo, dapo, gspo, clip_cov
    return _constant_bounds(mu, max(1 - cfg.delta, 0.0), 1 + cfg.delta_high)


def _cispo_bounds(mu, cfg):  # where the importance weight is not truncated
    return _constant_bounds(mu, 0.0, 1 + cfg.delta)


def _gmpo_bounds(mu, cfg):  # GMPO clips log w to [-d, d_high]
    return _constant_bounds(mu, math.exp(-cfg.delta), math.exp(cfg.delta_high))


def _kl1_bounds(mu, cfg):
    return _constant_bounds(mu, math.exp(-cfg.delta), math.inf)


def _kl2_bounds(mu, cfg):
    edge = math.sqrt(2 * cfg.delta)
    return _constant_bounds(mu, math.exp(-edge), math.exp(edge))


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


def grid_distance(divergence: str, estimator: str, log_w: Tensor, old_logp: Tensor,
                  cfg: LossConfig) -> Tensor:
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
RULES: dict[str, Rule] = {  # the registry: add a rule here
    "grpo": Rule(_ppo_objective, bounds=_interval_bounds, delta=0.2),
    "dapo": Rule(_ppo_objective, bounds=_interval_bounds, delta=0.2, delta_high=0.28),
    "kl1": Rule(_ppo_objective, _sampled_kl_region(lambda lw: -lw), _kl1_bounds, delta=-math.log(0.8)),
    "kl2": Rule(_ppo_objective, _sampled_kl_region(lambda lw: lw**2 / 2), _kl2_bounds, delta=math.log(0.8) ** 2 / 2),
    "kl3": _KL3,
    "atr": _KL3,
    "kl_full": Rule(_ppo_objective, _bernoulli_kl_region, delta=0.07),
    "dcpo": Rule(_ppo_objective, bounds=_dcpo_bounds, delta=0.2, delta_high=0.28),
    "gspo": Rule(_gspo_objective, bounds=_interval_bounds, delta=3e-4, delta_high=4e-4),
    "gmpo": Rule(_gmpo_objective, bounds=_gmpo_bounds, delta=0.4),
    "cispo": Rule(_cispo_objective, bounds=_cispo_bounds, delta=0.2),
    "sapo": Rule(_sapo_objective),
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


def _inside(rule: Rule, log_w: Tensor, old_logp: Tensor, cfg: LossConfig) -> Tensor:
    """Evaluate a rule's region in float64; soft rules have none, so every token is inside."""
    if rule.region is not None:
        return rule.region(log_w, old_logp, cfg)
    if rule.bounds is not None:
        lo, hi = rule.bounds(old_logp.exp(), cfg)
        return (log_w.exp() >= lo) & (log_w.exp() <= hi)
    return torch.ones_like(log_w, dtype=torch.bool)


# ----------------------------------------------------------------------------- interval and calibration


def _as_probabilities(name: str, x) -> Tensor:
    x = torch.as_tensor(x, dtype=torch.float64)
    if not ((x > 0) & (x <= 1)).all():
        raise ValueError(f"{name} must be probabilities in (0, 1]")
    return x


def ratio_bounds(rule: str | tuple[str, str], delta: float, mu, **options) -> tuple[Tensor, Tensor]:
    """The ratio interval [lo, hi] a rule admits at old probability mu (float or tensor), float64.

    Closed forms where they exist; otherwise bisection on log w (64 steps, vectorized over mu).
    An unbounded side is 0 or inf. options: other LossConfig fields (delta_high, tv_half, kl_two_sided).
    """
    cfg = LossConfig(rule=rule, delta=delta, **options)
    spec = get_rule(cfg.rule)
    mu = _as_probabilities("mu", mu)
    if spec.bounds is not None:
        lo, hi = spec.bounds(mu, cfg)
        return lo.expand_as(mu), hi.expand_as(mu)
    if spec.region is None:
        raise ValueError(f"rule {rule!r} has no trust region, so no ratio interval")
    old_logp = mu.log()

    def edge(direction: float) -> Tensor:  # every region is an interval in log w around 0
        inner, outer = torch.zeros_like(mu), torch.full_like(mu, direction * SEARCH_CAP)
        unbounded = spec.region(outer, old_logp, cfg)
        for _ in range(64):
            middle = (inner + outer) / 2
            ok = spec.region(middle, old_logp, cfg)
            inner, outer = torch.where(ok, middle, inner), torch.where(ok, outer, middle)
        return torch.where(unbounded, math.exp(direction * math.inf), inner.exp())

    return edge(-1.0), edge(1.0)


def calibrate_delta(rule: str | tuple[str, str], mu, w, target_clip_frac: float, *,
                    advantages: Tensor | None = None, **options) -> float:
    """The smallest delta whose region clips at most target_clip_frac of recorded (mu, w) pairs.

    Without advantages a token counts as clipped when it is outside the region; with them, only when
    it is also pushed outward (what policy_loss reports). Asymmetric rules keep delta_high/delta fixed;
    for gspo pass sequence ratios as w. Bisection: regions grow with delta, so the fraction only falls.
    """
    cfg = LossConfig(rule=rule, **options)
    spec = get_rule(cfg.rule)
    if cfg.rule == "kl_full" or cfg.delta is None:
        raise ValueError(f"rule {rule!r} cannot be calibrated on (mu, w) pairs")
    if not 0 <= target_clip_frac <= 1:
        raise ValueError(f"target_clip_frac must be in [0, 1], got {target_clip_frac}")
    mu, w = _as_probabilities("mu", mu), torch.as_tensor(w, dtype=torch.float64)
    if w.shape != mu.shape or not (w > 0).all():
        raise ValueError(f"w must be positive with mu's shape {tuple(mu.shape)}, got {tuple(w.shape)}")
    log_w, old_logp = w.log(), mu.log()
    high_per_low = cfg.delta_high / cfg.delta if cfg.delta else 1.0

    def clip_frac(delta: float) -> float:
        resized = dataclasses.replace(cfg, delta=delta, delta_high=delta * high_per_low)
        outside = ~_inside(spec, log_w, old_logp, resized)
        if advantages is not None:
            outside &= advantages.double() * (w - 1) > 0
        return outside.double().mean().item()

    low, high = 0.0, cfg.delta or 1.0
    while clip_frac(high) > target_clip_frac:
        if high > 1e6:  # e.g. DCPO never admits w > 10
            raise ValueError(f"target_clip_frac={target_clip_frac} is unreachable for rule {rule!r}")
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if clip_frac(middle) <= target_clip_frac else (middle, high)
    return high


# ----------------------------------------------------------------------------- exact vocabulary KL


@torch.no_grad()
def full_vocab_kl(old_hidden: Tensor, new_hidden: Tensor, lm_head_weight: Tensor, *,
                  temperature: float = 1.0, chunk_tokens: int = 256) -> Tensor:
    """Exact KL(old || new) of the next-token distributions over the whole vocabulary, [B, T] float32.

    old_hidden, new_hidden: [B, T, H] final hidden states (after the last norm) of the sampling and
    the current policy at the positions whose lm_head output scores logp's tokens; lm_head_weight:
    [V, H], frozen. Cost: one extra lm_head matmul per token for the old and for the new states
    (2 * 2*H*V FLOPs per token), and O(chunk_tokens * V) float32 memory, never [B, T, V].
    """
    if old_hidden.shape != new_hidden.shape or old_hidden.dim() != 3 or old_hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(f"old_hidden {tuple(old_hidden.shape)} and new_hidden {tuple(new_hidden.shape)} must be "
                         f"[B, T, H] with H = lm_head_weight.shape[1] = {lm_head_weight.shape[1]}")
    old_flat, new_flat = old_hidden.flatten(0, 1), new_hidden.flatten(0, 1)  # [B*T, H]
    kl = torch.empty(old_flat.shape[0], dtype=torch.float32, device=old_hidden.device)
    for start in range(0, old_flat.shape[0], chunk_tokens):  # chunks of tokens, each [chunk, V]
        chunk = slice(start, start + chunk_tokens)
        old_logp = F.log_softmax((old_flat[chunk] @ lm_head_weight.T).float() / temperature, dim=-1)
        new_logp = F.log_softmax((new_flat[chunk] @ lm_head_weight.T).float() / temperature, dim=-1)
        kl[chunk] = (old_logp.exp() * (old_logp - new_logp)).sum(-1).clamp_min(0)
    return kl.view(old_hidden.shape[:2])


# ----------------------------------------------------------------------------- the loss


def _check_inputs(logp, old_logp, advantages, mask, ref_logp, vocab_kl) -> tuple[Tensor, Tensor]:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("vocab_kl", vocab_kl)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logp's {tuple(logp.shape)}")
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


def _dual_clipped(w: Tensor, adv: Tensor, dual_clip) -> Tensor:
    if dual_clip is None:
        return torch.zeros_like(w, dtype=torch.bool)
    lo, hi = _dual_bounds(dual_clip)
    return ((adv < 0) & (w > hi)) | ((adv > 0) & (w < lo))


@torch.no_grad()
def _metrics(log_ratio, old_logp, adv, mask, clipped, cfg, ref_kl) -> dict[str, float]:
    log_w, a, c = log_ratio[mask].double(), adv[mask].double(), clipped[mask].double()
    w = log_w.exp()
    stats = {
        "clip_low_frac": (c < 0).double().mean(),
        "clip_high_frac": (c > 0).double().mean(),
        "dual_clip_frac": _dual_clipped(w, a, cfg.dual_clip).double().mean(),
        "approx_kl": (torch.expm1(log_w) - log_w).mean(),  # k3 estimate of KL(old || new)
        "ratio_min": w.min(), "ratio_mean": w.mean(), "ratio_max": w.max(),
    }
    if ref_kl is not None:
        stats["ref_kl"] = ref_kl.detach()[mask].double().mean()
    edges = torch.tensor(MU_EDGES, dtype=torch.float64, device=log_w.device)
    bucket = F.one_hot(torch.bucketize(old_logp[mask].double().exp(), edges), len(MU_LABELS)).double()  # [n, 5]
    count = bucket.sum(0)
    share, sign = count / len(w), (bucket * a.sign()[:, None]).sum(0) / count.clamp_min(1)
    clip = (bucket * (c != 0)[:, None]).sum(0) / count.clamp_min(1)
    for i, label in enumerate(MU_LABELS):
        stats |= {f"mu[{label}]/share": share[i], f"mu[{label}]/adv_sign": sign[i], f"mu[{label}]/clip_frac": clip[i]}
    return dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # one device sync


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, cfg: LossConfig, *,
                num_tokens: int | Tensor | None = None, num_seqs: int | Tensor | None = None,
                ref_logp: Tensor | None = None, vocab_kl: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The policy-gradient loss of cfg.rule and its diagnostics.

    logp, old_logp, mask: [B, T] (mask True on completion tokens); advantages: [B] or [B, T].
    Aggregation: token-mean = sum / num_tokens; seq-mean-token-mean = sum of per-sequence means /
    num_seqs; seq-mean-token-sum-norm (Dr. GRPO) = sum / (num_seqs * norm_len). For gradient
    accumulation pass the whole optimizer step's num_tokens / num_seqs (default: this batch's) and
    sum the micro-batch losses. ref_logp: [B, T] reference log-probs, needed when cfg.kl_beta > 0;
    vocab_kl: [B, T] from full_vocab_kl, needed by rule "kl_full".
    metrics: plain floats, clip fractions, k3 KL, ratio range and a table by old-probability bucket.
    """
    mask, adv = _check_inputs(logp, old_logp, advantages, mask, ref_logp, vocab_kl)
    rule = get_rule(cfg.rule)
    old_logp = old_logp.detach()  # the sampling policy is a constant
    log_ratio = torch.where(mask, logp - old_logp, 0).clamp(-LOG_RATIO_CAP, LOG_RATIO_CAP)  # [B, T]
    if cfg.rule == "kl_full" and vocab_kl is None:
        raise ValueError("rule 'kl_full' needs vocab_kl=full_vocab_kl(old_hidden, new_hidden, lm_head_weight)")

    def inside_of(log_w: Tensor) -> Tensor:  # the rule's region at these ratios, [B, T] bool
        if cfg.rule == "kl_full":  # the one region that depends on more than the sampled token
            return vocab_kl.detach() <= cfg.delta
        return _inside(rule, log_w.detach().double(), old_logp.double(), cfg)

    objective, clipped = rule.objective(logp, log_ratio, adv, mask, cfg, inside_of)
    token_loss, ref_kl = -objective, None
    if cfg.kl_beta:
        if ref_logp is None:
            raise ValueError(f"kl_beta={cfg.kl_beta} needs ref_logp, the reference policy's log-probs")
        ref_kl = _reference_kl(logp, ref_logp.detach(), cfg.kl_estimator)
        token_loss = token_loss + cfg.kl_beta * ref_kl
    loss = _aggregate(token_loss, mask, cfg, num_tokens, num_seqs)
    return loss, _metrics(log_ratio, old_logp, adv, mask, clipped, cfg, ref_kl)
