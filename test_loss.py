"""Tests for loss.py: every expected value is computed here from the rules' published formulas."""

import dataclasses
import json
import math
import statistics

import pytest
import sympy
import torch
import torch.nn.functional as F

import config
from loss import (
    AGGREGATIONS,
    INPUTS,
    LIMIT_SETTINGS,
    RULES,
    LossConfig,
    Rule,
    advantages,
    full_vocab_kl,
    group_advantages,
    metric_share,
    policy_loss,
    ppo_clip,
    ppo_objective,
    ratio_bounds,
    register,
    required_inputs,
)

f64 = torch.float64


def random_tokens(B=6, T=8, seed=0, spread=0.5, min_prob=1e-4):
    """Old probabilities log-uniform in min_prob..0.95, new = old * w with w log-normal (kept <= 1)."""
    g = torch.Generator().manual_seed(seed)
    old_logp = torch.empty(B, T, dtype=f64).uniform_(math.log(min_prob), math.log(0.95), generator=g)
    log_w = spread * torch.randn(B, T, dtype=f64, generator=g)
    logp = torch.minimum(old_logp + log_w, torch.tensor(-1e-3, dtype=f64))
    adv = torch.randn(B, dtype=f64, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logp.requires_grad_(), old_logp, adv, mask


def grad_of(logp, old_logp, adv, mask, cfg, **kwargs):
    logp = logp.detach().clone().requires_grad_()
    loss, metrics = policy_loss(logp, old_logp, adv, mask, cfg, **kwargs)
    loss.backward()
    return loss.detach(), logp.grad, metrics


# A rule defined here and added with loss.register: one entry, and one row in INSIDE below. The tests that
# run over the registry (bounds, the textbook clip, the flags, the no-NaN sweep) then cover it too.
register(
    "sqrt_band",
    Rule(
        ppo_objective,
        lambda mu, cfg: ((1 - cfg.delta / mu.sqrt()).clamp_min(0), 1 + cfg.delta / mu.sqrt()),
        ("delta", *LIMIT_SETTINGS),
        delta=0.2,
    ),
)


@pytest.fixture(scope="module", autouse=True)
def the_rule_defined_here_leaves_with_this_module():
    yield
    del RULES["sqrt_band"]


# Each rule's region written from its paper's formula, on w and mu = old probability.
def bernoulli_rest(mu, w):
    return (1 - mu * w) / (1 - mu)


def dcpo_inside(mu, w, d=0.2, d_high=0.28):
    lo = 0.5 + 0.5 * torch.sqrt(torch.clamp(1 - 4 * d / mu, min=0))
    hi = torch.clamp(0.5 + 0.5 * torch.sqrt(1 + 4 * d_high / mu), max=10)
    return (w >= lo) & (w <= hi)


INSIDE = {
    "grpo": lambda mu, w: (w >= 0.8) & (w <= 1.2),
    "dapo": lambda mu, w: (w >= 0.8) & (w <= 1.28),
    "kl1": lambda mu, w: -torch.log(w) <= -math.log(0.8),
    "kl2": lambda mu, w: 0.5 * torch.log(w) ** 2 <= 0.5 * math.log(0.8) ** 2,
    "kl3": lambda mu, w: w - 1 - torch.log(w) <= 0.07,
    ("tv", "mc"): lambda mu, w: (w - 1).abs() <= 0.2,
    ("kl", "atomic"): lambda mu, w: mu * torch.log(w).abs() <= -math.log(0.8),
    ("chi2", "atomic"): lambda mu, w: mu * (w - 1) ** 2 <= 0.04,
    ("hellinger", "binary"): lambda mu, w: (
        mu * (w.sqrt() - 1) ** 2 + (1 - mu) * (bernoulli_rest(mu, w).sqrt() - 1) ** 2 <= (math.sqrt(0.8) - 1) ** 2
    ),
    ("kl", "binary"): lambda mu, w: (
        mu * torch.log(w).abs() + (1 - mu) * torch.log(bernoulli_rest(mu, w)).abs() <= -math.log(0.8)
    ),
    "dcpo": dcpo_inside,
    "dppo": lambda mu, w: (mu * w - mu).abs() <= 0.2,  # DPPO's Binary-TV: |pi - mu| <= delta
    "sqrt_band": lambda mu, w: mu.sqrt() * (w - 1).abs() <= 0.2,
}


# ----------------------------------------------------------------------------- bounds


@pytest.mark.parametrize("delta", [0.01, 0.07, 0.5, 3.0])
def test_kl3_bounds_via_lambert_w(delta):
    lo, hi = ratio_bounds("kl3", delta, torch.tensor([0.5, 0.01]))
    kl3 = lambda w: w - 1 - math.log(w)  # noqa: E731
    for l, u in zip(lo.tolist(), hi.tolist()):
        assert kl3(l) == pytest.approx(delta, abs=1e-12) and kl3(u) == pytest.approx(delta, abs=1e-12)
        assert 1 - l < u - 1  # KL3 is steeper below 1: the region is wider above
        x = -math.exp(-1 - delta)
        assert l == pytest.approx(-float(sympy.LambertW(x, 0).evalf(30)), rel=1e-12)
        assert u == pytest.approx(-float(sympy.LambertW(x, -1).evalf(30)), rel=1e-12)
    assert torch.equal(ratio_bounds("atr", delta, 0.3)[1], ratio_bounds("kl3", delta, 0.3)[1])


def test_atomic_interval_widens_as_mu_falls():
    mu = torch.logspace(0, -3, 200, dtype=f64)  # falling
    lo, hi = ratio_bounds(("kl", "atomic"), 0.223, mu)
    assert (lo.diff() <= 0).all() and (hi.diff() >= 0).all() and (hi.diff() > 0).any()
    torch.testing.assert_close(hi, torch.exp(0.223 / mu), rtol=1e-12, atol=0)  # mu*log(hi) = delta
    crossing = 0.223 / math.log(10)  # ~0.0968
    hi_around = ratio_bounds(("kl", "atomic"), 0.223, torch.tensor([crossing * 1.01, crossing * 0.99]))[1]
    assert hi_around[0] < 10 < hi_around[1]


def test_grid_bounds_match_closed_forms_and_conventions():
    mu = torch.tensor([0.9, 0.5, 0.2, 0.05], dtype=f64)
    lo, hi = ratio_bounds(("tv", "binary"), 0.2, mu)  # binary TV is 2*mu*|w-1|
    torch.testing.assert_close(lo, torch.clamp(1 - 0.1 / mu, min=0))
    torch.testing.assert_close(hi, torch.minimum(1 + 0.1 / mu, 1 / mu))
    lo, hi = ratio_bounds(("chi2", "atomic"), 0.04, mu)
    torch.testing.assert_close(lo, torch.clamp(1 - (0.04 / mu).sqrt(), min=0))
    torch.testing.assert_close(hi, 1 + (0.04 / mu).sqrt())
    lo, hi = ratio_bounds(("kl", "mc"), 0.223, 0.5)
    assert (lo.item(), hi.item()) == pytest.approx((math.exp(-0.223), math.exp(0.223)))
    defaults = {f: LossConfig(rule=(f, "mc")).delta for f in ("tv", "chi2", "hellinger", "kl")}
    f_of_08 = {"tv": 0.2, "chi2": 0.04, "hellinger": (math.sqrt(0.8) - 1) ** 2, "kl": -math.log(0.8)}
    assert defaults == pytest.approx(f_of_08, rel=1e-10)
    assert LossConfig(rule=("tv", "mc"), tv_half=True).delta == pytest.approx(0.1)
    assert ratio_bounds(("tv", "mc"), 0.1, 0.5, tv_half=True)[1].item() == pytest.approx(1.2)
    lo, hi = ratio_bounds(("kl", "mc"), 0.223, 0.5, kl_two_sided=False)
    assert lo.item() == pytest.approx(math.exp(-0.223)) and hi.item() == math.inf


def test_dppo_is_its_band_and_the_tv_cells_keep_their_conventions():
    mu = torch.tensor([0.9, 0.5, 0.2, 0.05, 0.01], dtype=f64)
    lo, hi = ratio_bounds("dppo", 0.2, mu)
    torch.testing.assert_close(lo, torch.clamp(1 - 0.2 / mu, min=0), rtol=0, atol=0)
    torch.testing.assert_close(hi, 1 + 0.2 / mu, rtol=0, atol=0)
    # the same band as the atomic TV cell at 0.2; the binary cell is half of it unless TV takes the 1/2
    atomic = ratio_bounds(("tv", "atomic"), 0.2, mu)
    for ours, cell in zip((lo, hi), atomic):
        torch.testing.assert_close(ours, cell, rtol=1e-12, atol=1e-15)
    assert [b.item() for b in ratio_bounds("tv-binary", None, 0.05)] == pytest.approx([0.0, 3.0])
    halved = ratio_bounds("tv-binary", 0.2, mu, tv_half=True)
    below_cap = mu <= 0.8  # where 1 + 0.2/mu stays under 1/mu, the highest ratio a probability allows
    torch.testing.assert_close(halved[0], lo, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(halved[1][below_cap], hi[below_cap], rtol=1e-12, atol=0)
    torch.testing.assert_close(halved[1][~below_cap], 1 / mu[~below_cap], rtol=1e-12, atol=0)


def test_kl_full_interval_is_the_bernoulli_kl_bound_and_dcpo_matches_its_roots():
    mu = torch.tensor([0.9, 0.5, 0.05], dtype=f64)
    lo, hi = ratio_bounds("kl_full", 0.07, mu)
    for bound in (lo, hi):
        bernoulli_kl = mu * torch.log(1 / bound) + (1 - mu) * torch.log((1 - mu) / (1 - mu * bound))
        torch.testing.assert_close(bernoulli_kl, torch.full_like(mu, 0.07), rtol=1e-9, atol=0)
    mu = torch.tensor([0.95, 0.85], dtype=f64)  # mu > 4*delta: DCPO's roots are interior (no 1/2 or 10 cap)
    lo, hi = ratio_bounds("dcpo", 0.2, mu)
    torch.testing.assert_close(mu * lo * (1 - lo), torch.full_like(mu, 0.2))
    torch.testing.assert_close(mu * hi * (hi - 1), torch.full_like(mu, 0.28))
    assert ratio_bounds("dcpo", 0.2, 0.001)[0].item() == 0.5 and ratio_bounds("dcpo", 0.2, 0.001)[1].item() == 10


@pytest.mark.parametrize("rule", list(INSIDE), ids=str)
def test_a_rules_bounds_are_the_edges_of_its_papers_region(rule):
    mu = torch.tensor([0.9, 0.5, 0.05, 0.001], dtype=f64)
    lo, hi = ratio_bounds(rule, None, mu)
    for edge, side in ((lo, -1), (hi, 1)):
        finite = (edge > 0) & (edge < math.inf)
        assert INSIDE[rule](mu, edge * (1 - side * 1e-9))[finite].all()
        assert not INSIDE[rule](mu, edge * (1 + side * 1e-9))[finite].any()
        assert INSIDE[rule](mu, torch.full_like(mu, 1e-30 if side < 0 else 1e30))[~finite].all()  # unbounded


# ----------------------------------------------------------------------------- the clip operator

INTERVAL_RULES = [name for name, rule in RULES.items() if rule.objective is ppo_objective]


@pytest.mark.parametrize("options", [{}, {"ratio_limits": (0.7, 2.0)}, {"dual_clip": 3.0}], ids=str)
@pytest.mark.parametrize("rule", INTERVAL_RULES)
def test_the_clip_operator_is_textbook_ppo_for_every_interval_rule(rule, options):
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=15, spread=1.0, min_prob=1e-3)
    cfg = LossConfig(rule=rule, **options)
    value, grad, metrics = grad_of(logp, old_logp, adv, mask, cfg)
    ppo_logp = logp.detach().clone().requires_grad_()
    w, a = (ppo_logp - old_logp).exp(), adv[:, None]
    lo, hi = ratio_bounds(rule, None, old_logp.exp(), **options)  # the rule's interval within the limits
    objective = ppo_clip(w, a, lo, hi)
    if "dual_clip" in options:  # dual-clip PPO: max(min(w*A, clip(w)*A), c*A) where A < 0
        objective = torch.where(a < 0, torch.max(objective, options["dual_clip"] * a), objective)
    textbook = -(objective * mask).sum() / mask.sum()
    textbook.backward()
    assert value.item() == pytest.approx(textbook.item(), rel=1e-12)
    torch.testing.assert_close(grad, ppo_logp.grad, rtol=1e-12, atol=0)
    stopped = ((ppo_logp.grad == 0) & mask).sum() / mask.sum()
    counted = metrics["clip_low_frac"] + metrics["clip_high_frac"] + metrics["limit_clip_frac"]
    assert counted == pytest.approx(stopped.item())
    assert stopped > 0 or (rule == "interval" and not options)  # the interval rule alone clips nothing


@pytest.mark.parametrize("rule", list(INSIDE), ids=str)
def test_gradient_is_zero_outside_pushed_outward_and_minus_a_w_over_n_elsewhere(rule):
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=1, spread=0.8, min_prob=0.2)
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, LossConfig(rule=rule))
    mu, w, a = old_logp.exp(), (logp - old_logp).exp().detach(), adv[:, None].expand_as(logp)
    outside = ~INSIDE[rule](mu, w)
    outward = outside & (a * (w - 1) > 0) & mask
    n = mask.sum()
    assert (outward & (w < 1)).any() and ((outward & (w > 1)).any() or rule == "kl1")  # kl1: no upper edge
    assert (outside & ~outward & mask).any()  # and tokens outside that are pulled back in
    assert (grad[outward] == 0).all()
    kept = mask & ~outward
    torch.testing.assert_close(grad[kept], (-a * w / n)[kept], rtol=1e-12, atol=0)
    assert (grad[~mask] == 0).all()
    assert metrics["clip_low_frac"] == pytest.approx(((outward & (w < 1)).sum() / n).item())
    assert metrics["clip_high_frac"] == pytest.approx(((outward & (w > 1)).sum() / n).item())


def test_grpo_equals_tv_mc_token_for_token():
    logp, old_logp, adv, mask = random_tokens(seed=2, spread=0.4)
    loss_grpo, grad_grpo, metrics_grpo = grad_of(logp, old_logp, adv, mask, LossConfig(rule="grpo"))
    loss_tv, grad_tv, metrics_tv = grad_of(logp, old_logp, adv, mask, LossConfig(rule=("tv", "mc"), delta=0.2))
    assert torch.equal(grad_grpo, grad_tv) and torch.equal(loss_grpo, loss_tv) and metrics_grpo == metrics_tv
    assert (grad_grpo == 0).any()


def test_dual_clip_stops_negative_advantage_tokens_above_c():
    old_logp = torch.full((1, 4), -3.0, dtype=f64)
    logp = old_logp + torch.tensor([[math.log(4.0), math.log(2.0), math.log(4.0), math.log(0.5)]], dtype=f64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=f64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, LossConfig(rule="grpo", dual_clip=3.0))
    # w=4, A<0: dual-clipped. w=2, A<0: outside but pulled back in, kept. w=4, A>0 and w=0.5, A<0: pushed out.
    expected = torch.tensor([0.0, 1.0 * 2.0 / 4, 0.0, 0.0], dtype=f64)
    assert torch.equal(grad[0] == 0, expected == 0)
    torch.testing.assert_close(grad[0], expected)
    assert metrics["limit_clip_frac"] == 0.25 and metrics["clip_high_frac"] == 0.25  # counted apart


def test_dual_clip_pair_also_stops_positive_advantage_tokens_below_lo():
    old_logp = torch.full((1, 4), -3.0, dtype=f64)
    w = torch.tensor([0.4, 0.6, 12.0, 8.0], dtype=f64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=f64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    # (kl, atomic) at mu = e^-3 admits every one of these ratios, so only the dual clip stops any
    _, grad, metrics = grad_of(
        old_logp + w.log()[None], old_logp, adv, mask, LossConfig(rule=("kl", "atomic"), dual_clip=(0.5, 10.0))
    )
    expected = torch.tensor([0.0, -1.0 * 0.6 / 4, 0.0, 1.0 * 8.0 / 4], dtype=f64)
    torch.testing.assert_close(grad[0], expected)
    assert metrics["limit_clip_frac"] == 0.5


# ----------------------------------------------------------------------------- other rules


def test_sapo_gradient_weight_is_one_at_ratio_one_and_follows_the_gate():
    old_logp = torch.full((2, 3), -2.0, dtype=f64)
    log_w = torch.tensor([[0.0, 0.3, -0.4], [0.0, 0.5, -0.2]], dtype=f64)
    adv = torch.tensor([1.5, -0.7], dtype=f64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, grad, _ = grad_of(old_logp + log_w, old_logp, adv, mask, LossConfig(rule="sapo"))
    a = adv[:, None].expand(2, 3)
    assert grad[0, 0].item() == pytest.approx(-1.5 / 6, rel=1e-15)  # weight exactly 1 at w = 1
    assert grad[1, 0].item() == pytest.approx(0.7 / 6, rel=1e-15)
    w, tau = log_w.exp(), torch.where(a > 0, 1.0, 1.05)
    gate = torch.sigmoid(tau * (w - 1))
    torch.testing.assert_close(grad, -a * 4 * gate * (1 - gate) * w / 6, rtol=1e-12, atol=0)
    assert loss.item() == pytest.approx((-(a * 4 / tau * gate).sum() / 6).item(), rel=1e-12)


def test_cispo_never_drops_a_token_and_truncates_the_weight():
    logp, old_logp, adv, mask = random_tokens(seed=3, spread=0.6)
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, LossConfig(rule="cispo"))
    w, a = (logp - old_logp).exp().detach(), adv[:, None].expand_as(logp)
    expected = -torch.clamp(w, max=1.2) * a / mask.sum()
    torch.testing.assert_close(grad[mask], expected[mask], rtol=1e-12, atol=0)
    assert (grad[mask] != 0).all() and (w[mask] > 1.2).any()
    assert metrics["clip_high_frac"] == pytest.approx(((w > 1.2) & mask).sum().item() / mask.sum().item())


def test_gspo_clips_whole_sequences_on_the_geometric_mean_ratio():
    T = 4
    old_logp = torch.full((4, T), -1.0, dtype=f64)
    seq_log_ratio = torch.tensor([1e-4, 1e-2, 1e-2, -1e-2], dtype=f64)  # inside, above, above, below
    logp = old_logp + seq_log_ratio[:, None] + torch.tensor([0.02, -0.02, 0.01, -0.01], dtype=f64)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=f64)
    mask = torch.ones(4, T, dtype=torch.bool)
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, LossConfig(rule="gspo", aggregation="seq-mean-token-mean"))
    assert metrics["clip_high_frac"] == 0.25 and metrics["clip_low_frac"] == 0  # by s, not by each token's w
    s = seq_log_ratio.exp()
    # GSPO: d(-A s_i / B)/d logp_it = -A_i s_i / (|o_i| B); sequence 1 is above with A > 0: stopped.
    expected = (-adv * s / (T * 4))[:, None].expand(4, T) * torch.tensor([1, 0, 1, 1], dtype=f64)[:, None]
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)


def test_gmpo_matches_its_published_objective():
    logp, old_logp, adv, mask = random_tokens(seed=4, spread=0.5)
    loss, grad, _ = grad_of(logp, old_logp, adv, mask, LossConfig(rule="gmpo", aggregation="seq-mean-token-mean"))
    ref_logp = logp.detach().clone().requires_grad_()
    log_w = torch.where(mask, ref_logp - old_logp, 0)
    sign = adv.sign()[:, None]
    clipped = sign * torch.minimum(sign * log_w, sign * log_w.clamp(-0.4, 0.4))
    ratio = torch.exp(clipped.sum(-1) / mask.sum(-1))
    ref_loss = -(adv * ratio).mean()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    torch.testing.assert_close(grad, ref_logp.grad, rtol=1e-10, atol=1e-15)


def covariance(logp, adv, mask):
    a = adv[:, None].expand_as(logp)[mask]
    lp = logp.detach()[mask]
    return (a - a.mean()) * (lp - lp.mean())


def test_kl_cov_penalises_the_top_covariance_tokens():
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=5)
    cfg = LossConfig(rule="kl_cov", cov_ratio=0.05, kl_cov_coef=0.5)
    _, grad, _ = grad_of(logp, old_logp, adv, mask, cfg)
    n = mask.sum().item()
    k = int(0.05 * n)
    picked = torch.zeros(n, dtype=torch.bool)
    picked[covariance(logp, adv, mask).topk(k).indices] = True
    w, a = (logp - old_logp).exp().detach()[mask], adv[:, None].expand_as(logp)[mask]
    expected = (-a * w + 0.5 * picked * torch.log(w).sign()) / n
    torch.testing.assert_close(grad[mask], expected, rtol=1e-12, atol=1e-15)


def test_clip_cov_stops_a_few_tokens_from_the_covariance_window():
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=6, spread=0.3)
    cfg = LossConfig(rule="clip_cov", cov_ratio=0.05, clip_cov_bounds=(0.0, 1e9))
    torch.manual_seed(0)
    _, grad, _ = grad_of(logp, old_logp, adv, mask, cfg)
    w, a = (logp - old_logp).exp().detach()[mask], adv[:, None].expand_as(logp)[mask]
    ppo_clipped = (a * (w - 1) > 0) & ((w < 0.8) | (w > 1.2))
    extra = (grad[mask] == 0) & ~ppo_clipped
    assert extra.sum().item() == int(0.05 * mask.sum().item())
    assert (covariance(logp, adv, mask)[extra] > 0).all()
    kept = ~ppo_clipped & ~extra
    torch.testing.assert_close(grad[mask][kept], (-a * w / mask.sum())[kept], rtol=1e-12, atol=0)


def test_kl_full_uses_the_exact_vocabulary_kl():
    g = torch.Generator().manual_seed(7)
    B, T, H, V = 2, 5, 6, 11
    head = torch.randn(V, H, dtype=f64, generator=g)
    old_hidden = torch.randn(B, T, H, dtype=f64, generator=g)
    new_hidden = old_hidden + 0.3 * torch.randn(B, T, H, dtype=f64, generator=g)
    kl = full_vocab_kl(old_hidden, new_hidden, head, temperature=0.7, chunk_tokens=3)
    old_dist = torch.distributions.Categorical(logits=(old_hidden @ head.T) / 0.7)
    new_dist = torch.distributions.Categorical(logits=(new_hidden @ head.T) / 0.7)
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(old_dist, new_dist).float(), rtol=1e-5, atol=1e-7)

    tokens = torch.randint(V, (B, T), generator=g)
    old_logp = old_dist.log_prob(tokens)
    logp = new_dist.log_prob(tokens)
    adv = torch.tensor([1.0, -1.0], dtype=f64)
    mask = torch.ones(B, T, dtype=torch.bool)
    delta = kl.median().item()
    cfg = LossConfig(rule="kl_full", delta=delta)
    with pytest.raises(ValueError, match="hidden, lm_head_weight, old_hidden, temperature"):
        policy_loss(logp, old_logp, adv, mask, cfg)
    _, grad, _ = grad_of(
        logp, old_logp, adv, mask, cfg, old_hidden=old_hidden, hidden=new_hidden, lm_head_weight=head, temperature=0.7
    )
    w, a = (logp - old_logp).exp(), adv[:, None].expand(B, T)
    outward = (kl > delta) & (a * (w - 1) > 0)
    assert outward.any() and (~outward).any()
    assert (grad[outward] == 0).all()
    torch.testing.assert_close(grad[~outward], (-a * w / (B * T))[~outward], rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- aggregation


def test_gradient_accumulation_equals_one_big_batch():
    g = torch.Generator().manual_seed(8)
    B, T, H, V = 6, 5, 4, 7
    features = torch.randn(B, T, H, dtype=f64, generator=g)
    tokens = torch.randint(V, (B, T), generator=g)
    weight = torch.randn(H, V, dtype=f64, generator=g).requires_grad_()
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 4, 1, 3, 5])[:, None]
    adv = torch.randn(B, dtype=f64, generator=g)

    def logp_of(rows, w):
        return F.log_softmax(features[rows] @ w, -1).gather(-1, tokens[rows, :, None])[..., 0]

    old_logp = logp_of(slice(None), weight.detach() + 0.5 * torch.randn(H, V, dtype=f64, generator=g))
    micro_batches = [slice(0, 2), slice(2, 4), slice(4, 6)]
    for rule, aggregations in (("grpo", AGGREGATIONS), ("kl3", AGGREGATIONS), ("gspo", [None])):
        for aggregation in aggregations:  # gspo is defined with seq-mean-token-mean only
            cfg = LossConfig(rule=rule, aggregation=aggregation, norm_len=T)
            weight.grad = None
            full, _ = policy_loss(logp_of(slice(None), weight), old_logp, adv, mask, cfg)
            full.backward()
            full_grad = weight.grad.clone()
            weight.grad, total = None, 0.0
            for rows in micro_batches:
                part, _ = policy_loss(
                    logp_of(rows, weight), old_logp[rows], adv[rows], mask[rows], cfg, num_tokens=mask.sum(), num_seqs=B
                )
                part.backward()
                total += part.item()
            torch.testing.assert_close(weight.grad, full_grad, rtol=1e-10, atol=1e-14)
            assert total == pytest.approx(full.item(), rel=1e-10)
    # Each micro-batch normalized by its own token count gives another gradient.
    weight.grad = None
    cfg = LossConfig(rule="grpo")
    for rows in micro_batches:
        (policy_loss(logp_of(rows, weight), old_logp[rows], adv[rows], mask[rows], cfg)[0] / 3).backward()
    assert not torch.allclose(weight.grad, full_grad)


def test_aggregation_formulas():
    logp, old_logp, adv, mask = random_tokens(seed=9, spread=0.05)  # small steps: nothing clipped
    token_loss = -(adv[:, None] * (logp - old_logp).exp()).detach() * mask
    lengths = mask.sum(-1)
    expected = {
        "token-mean": token_loss.sum() / mask.sum(),
        "seq-mean-token-mean": (token_loss.sum(-1) / lengths).mean(),
        "seq-mean-token-sum-norm": token_loss.sum() / (len(adv) * 32),
    }
    for aggregation, value in expected.items():
        loss, _ = policy_loss(logp, old_logp, adv, mask, LossConfig(aggregation=aggregation, norm_len=32))
        assert loss.item() == pytest.approx(value.item(), rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_penalty(estimator):
    logp, old_logp, adv, mask = random_tokens(seed=10, spread=0.05)
    ref_logp = logp.detach() + 0.3 * torch.randn(logp.shape, dtype=f64, generator=torch.Generator().manual_seed(0))
    cfg = LossConfig(kl_beta=0.1, kl_estimator=estimator)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old_logp, adv, mask, cfg)
    zero_adv = torch.zeros_like(adv)
    loss, grad, metrics = grad_of(logp, old_logp, zero_adv, mask, cfg, ref_logp=ref_logp)
    ratio = ref_logp.exp() / logp.detach().exp()  # pi_ref / pi
    value, slope = {
        "k1": (-torch.log(ratio), torch.ones_like(ratio)),
        "k2": (0.5 * torch.log(ratio) ** 2, -torch.log(ratio)),
        "k3": (ratio - 1 - torch.log(ratio), 1 - ratio),
    }[estimator]
    n = mask.sum()
    assert loss.item() == pytest.approx((0.1 * value[mask].sum() / n).item(), rel=1e-12)
    torch.testing.assert_close(grad[mask], 0.1 * slope[mask] / n, rtol=1e-10, atol=0)
    assert metrics["ref_kl"] == pytest.approx(value[mask].mean().item(), rel=1e-12)


def test_entropy_bonus_is_subtracted_like_the_loss_and_differentiated():
    logp, old_logp, adv, mask = random_tokens(seed=11, spread=0.05)
    entropy = torch.rand(logp.shape, dtype=f64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    cfg = LossConfig(entropy_coef=0.01)
    assert required_inputs(cfg) == {"entropy"} and "entropy" in INPUTS
    with pytest.raises(ValueError, match="needs the inputs entropy"):
        policy_loss(logp, old_logp, adv, mask, cfg)
    for aggregation in AGGREGATIONS:
        base, _ = policy_loss(logp, old_logp, adv, mask, LossConfig(aggregation=aggregation))
        bonus = dataclasses.replace(cfg, aggregation=aggregation)
        loss, _ = policy_loss(logp, old_logp, adv, mask, bonus, entropy=entropy)
        only_entropy, _ = policy_loss(logp, old_logp, torch.zeros_like(adv), mask, bonus, entropy=entropy)
        assert loss.item() == pytest.approx(base.item() + only_entropy.item(), rel=1e-12)
    entropy.grad = None
    only_entropy, _ = policy_loss(logp, old_logp, torch.zeros_like(adv), mask, cfg, entropy=entropy)
    only_entropy.backward()
    n = mask.sum()
    assert only_entropy.item() == pytest.approx(-(0.01 * entropy.detach()[mask].sum() / n).item(), rel=1e-12)
    torch.testing.assert_close(entropy.grad[mask], torch.full_like(entropy.grad[mask], -0.01 / n.item()))
    assert (entropy.grad[~mask] == 0).all()


# ----------------------------------------------------------------------------- advantages


def test_group_advantages_against_hand_computation():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    groups = [rewards[:4], rewards[4:]]
    eps = 1e-6
    grpo = [(r - statistics.mean(g)) / (statistics.stdev(g) + eps) for g in groups for r in g]
    dr_grpo = [r - statistics.mean(g) for g in groups for r in g]
    batch = [(r - statistics.mean(g)) / (statistics.stdev(rewards) + eps) for g in groups for r in g]
    loo = [r - statistics.mean(g[:i] + g[i + 1 :]) for g in groups for i, r in enumerate(g)]
    assert group_advantages(rewards, 4).tolist() == pytest.approx(grpo, rel=1e-6)
    assert group_advantages(rewards, 4, std="none").tolist() == pytest.approx(dr_grpo, rel=1e-6)
    assert group_advantages(rewards, 4, std="batch").tolist() == pytest.approx(batch, rel=1e-6)
    assert group_advantages(rewards, 4, std="none", leave_one_out=True).tolist() == pytest.approx(loo, rel=1e-6)


@pytest.mark.parametrize("std", ["group", "batch", "none"])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_all_equal_rewards_give_exactly_zero_advantage(std, leave_one_out):
    rewards = [0.1] * 3 + [0.7] * 3 + [1.0, 0.0, 1.0]  # 3 * 0.1 / 3 != 0.1 in floating point
    adv = group_advantages(rewards, 3, std=std, leave_one_out=leave_one_out)
    assert torch.isfinite(adv).all() and (adv[:6] == 0).all() and (adv[6:] != 0).all()
    assert (group_advantages([0.0] * 8, 4, std=std, leave_one_out=leave_one_out) == 0).all()


# ----------------------------------------------------------------------------- numerics and diagnostics


ALL_RULES = list(RULES) + [(f, e) for f in ("tv", "chi2", "hellinger", "kl") for e in ("mc", "atomic", "binary")]


@pytest.mark.parametrize("rule", ALL_RULES, ids=str)
def test_no_nan_for_extreme_ratios(rule):
    log_w = torch.cat([torch.linspace(math.log(1e-30), math.log(1e30), 39), torch.tensor([-100.0, 100.0])])
    old_logp = (-log_w.clamp(min=0) - 0.01)[None, :].repeat(2, 1)  # keeps logp <= 0; float32 throughout
    logp = (old_logp + log_w).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 41, dtype=torch.bool)
    cfg = LossConfig(rule=rule, dual_clip=3.0, kl_beta=0.01)
    g = torch.Generator().manual_seed(0)
    hidden = dict(
        old_hidden=torch.randn(2, 41, 4, generator=g),
        hidden=torch.randn(2, 41, 4, generator=g),
        lm_head_weight=torch.randn(5, 4, generator=g),
        temperature=1.0,
    )
    loss, metrics = policy_loss(logp, old_logp, adv, mask, cfg, ref_logp=old_logp, **hidden)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())
    loss, _ = policy_loss(logp, old_logp, torch.zeros(2), mask, LossConfig(rule=rule), **hidden)
    assert torch.isfinite(loss)


def test_metrics_table_by_old_probability_bucket():
    mu = torch.tensor([[0.95, 0.95, 0.7, 0.3, 0.05, 0.005, 0.005, 0.5]], dtype=f64)
    w = torch.tensor([[1.0, 1.5, 1.0, 0.5, 1.0, 1.0, 2.0, 1.0]], dtype=f64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 0.0]], dtype=f64)
    mask = torch.tensor([[True] * 7 + [False]])
    _, metrics = policy_loss((mu * w).log(), mu.log(), adv, mask, LossConfig(rule="grpo"))
    json.dumps(metrics)
    assert all(type(v) is float for v in metrics.values())
    # clipped (pushed outward): w=1.5 A>0 (mu .95), w=0.5 A<0 (mu .3), w=2 A>0 (mu .005)
    assert metrics["clip_high_frac"] == pytest.approx(2 / 7) and metrics["clip_low_frac"] == pytest.approx(1 / 7)
    expected = {
        ">0.9": (2 / 7, 1.0, 0.5),
        "0.5-0.9": (1 / 7, -1.0, 0.0),
        "0.1-0.5": (1 / 7, -1.0, 1.0),
        "0.01-0.1": (1 / 7, 1.0, 0.0),
        "<0.01": (2 / 7, 0.0, 0.5),
    }
    for label, (share, sign, clip) in expected.items():
        got = (metrics[f"mu[{label}]/share"], metrics[f"mu[{label}]/adv_sign"], metrics[f"mu[{label}]/clip_frac"])
        assert got == pytest.approx((share, sign, clip)), label
    masked_w = w[mask]
    assert metrics["ratio_max"] == pytest.approx(2.0) and metrics["ratio_min"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(masked_w.mean().item())
    assert metrics["approx_kl"] == pytest.approx((masked_w - 1 - masked_w.log()).mean().item())


def test_clip_rates_of_acting_tokens_leave_out_zero_advantages():
    mu = torch.tensor([[0.95, 0.95, 0.3, 0.3, 0.005, 0.005]], dtype=f64)
    w = torch.tensor([[1.5, 1.5, 0.5, 1.0, 2.0, 2.0]], dtype=f64)
    adv = torch.tensor([[1.0, 0.0, -1.0, 0.0, 1.0, 1.0]], dtype=f64)  # per token, to place the zeros
    _, metrics = policy_loss((mu * w).log(), mu.log(), adv, torch.ones(1, 6, dtype=torch.bool), LossConfig(rule="grpo"))
    # stopped: w=1.5 A>0 (region), w=0.5 A<0 (region), both w=2 A>0 (region); the zero-advantage tokens never
    assert metrics["active_share"] == pytest.approx(4 / 6)
    assert metrics["active_clip_frac"] == pytest.approx(4 / 4)
    assert metrics["clip_low_frac"] + metrics["clip_high_frac"] == pytest.approx(4 / 6)  # over every token
    assert metrics["mu[>0.9]/active_share"] == pytest.approx(1 / 6)
    assert metrics["mu[>0.9]/active_clip_frac"] == 1.0 and metrics["mu[>0.9]/clip_frac"] == 0.5
    assert metrics["mu[0.5-0.9]/active_clip_frac"] == 0.0  # no tokens: 0, weighted by its share 0 when merged
    assert metric_share("mu[>0.9]/active_clip_frac") == "mu[>0.9]/active_share"
    assert metric_share("mu[>0.9]/clip_frac") == "mu[>0.9]/share"
    assert metric_share("active_clip_frac") == "active_share"
    assert {metric_share(k) for k in ("mu[>0.9]/share", "mu[>0.9]/active_share", "approx_kl")} == {None}


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rule": "ppo-ish"}, "--rule ppo-ish: unknown rule 'ppo-ish'; known: grpo, dapo"),
        ({"rule": ("kl", "guess")}, r"--rule kl,guess: unknown rule \('kl', 'guess'\)"),
        ({"rule": "kl3", "delta": -0.1}, "--delta -0.1: must be >= 0"),
        ({"rule": "dapo", "delta_high": -0.1}, "--delta-high -0.1: must be >= 0"),
        ({"delta": math.nan}, "--delta nan: must be a finite number"),
        ({"aggregation": "mean"}, "--aggregation mean: expected one of token-mean, "),
        ({"rule": "gspo", "aggregation": "token-mean"}, "--aggregation token-mean: rule gspo is sequence-level"),
        ({"dual_clip": 0.5}, "--dual-clip 0.5: expected c > 1, or lo,hi with 0 < lo < 1 < hi"),
        ({"dual_clip": (1.5, 10.0)}, "--dual-clip 1.5,10: expected"),
        ({"dual_clip": (0.5, 0.9)}, "--dual-clip 0.5,0.9: expected"),
        ({"dual_clip": (0.5,)}, "--dual-clip 0.5: expected"),
        ({"ratio_limits": "2,1"}, "--ratio-limits 2,1: expected lo,hi with 0 <= lo < 1 < hi"),
        ({"ratio_limits": [2, 1]}, "--ratio-limits 2,1: expected"),  # a JSON list
        ({"ratio_limits": "0.5"}, "--ratio-limits 0.5: expected"),
        ({"ratio_limits": (1.0, 10.0)}, "--ratio-limits 1,10: expected"),
        ({"ratio_limits": (-0.1, 2.0)}, "--ratio-limits -0.1,2: expected"),
        ({"ratio_limits": "a,b"}, "--ratio-limits a,b: expected numbers separated by commas"),
        ({"adv_std": "global"}, "--adv-std global: expected one of group, batch, none"),
        ({"entropy_coef": -0.1}, "--entropy-coef -0.1: must be >= 0"),
        ({"kl_beta": -1.0}, "--kl-beta -1.0: must be >= 0"),
        ({"kl_estimator": "k4"}, "--kl-estimator k4: expected one of k1, k2, k3"),
        ({"norm_len": 0}, "--norm-len 0: must be >= 1"),
        ({"rule": "sapo", "sapo_tau_neg": 0.0}, "--sapo-tau-neg 0.0: must be > 0"),
        ({"rule": "kl_cov", "cov_ratio": 0.0}, r"--cov-ratio 0.0: must be in \(0, 1\]"),
        ({"rule": "clip_cov", "clip_cov_bounds": (2.0, 1.0)}, "--clip-cov-bounds 2,1: expected lo,hi with lo < hi"),
    ],
    ids=str,
)
def test_a_bad_setting_fails_in_one_line_naming_its_flag(options, message):
    with pytest.raises(ValueError, match=message) as error:
        LossConfig(**options)
    assert "\n" not in str(error.value)


def test_bad_input_raises_value_errors_naming_the_argument():
    logp, old_logp, adv, mask = random_tokens()
    with pytest.raises(ValueError, match="--delta -0.2"):
        ratio_bounds("grpo", -0.2, 0.5)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, old_logp[:, :-1], adv, mask, LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old_logp, adv[:-1], mask, LossConfig())
    with pytest.raises(ValueError, match="mask"):
        policy_loss(logp, old_logp, adv, torch.zeros_like(mask), LossConfig())
    with pytest.raises(ValueError, match="mu"):
        ratio_bounds("kl3", 0.07, torch.tensor([0.0, 0.5]))
    with pytest.raises(ValueError, match="sapo"):
        ratio_bounds("sapo", 0.1, 0.5)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0, 0.0, 1.0], 2)
    with pytest.raises(ValueError, match="std must be one of group, batch, none"):
        group_advantages([1.0, 0.0], 2, std="global")


# ----------------------------------------------------------------------------- ratio limits


def test_ratio_limits_intersect_the_interval_and_the_interval_rule_is_the_limits_alone():
    mu = torch.tensor([0.5, 0.2, 0.05, 0.005], dtype=f64)
    lo, hi = ratio_bounds("kl-atomic", None, mu, ratio_limits=(0.5, 10.0))
    cell_lo, cell_hi = ratio_bounds("kl-atomic", None, mu)
    torch.testing.assert_close(lo, cell_lo.clamp_min(0.5))
    torch.testing.assert_close(hi, cell_hi.clamp_max(10))
    assert hi[:2].lt(10).all() and hi[2:].eq(10).all()  # kl-atomic passes 10 below mu = 0.097
    lo, hi = ratio_bounds("interval", None, mu)
    assert (lo == 0).all() and (hi == math.inf).all()
    lo, hi = ratio_bounds("interval", None, mu, ratio_limits="0.5,10")
    assert (lo == 0.5).all() and (hi == 10).all()


def test_interval_rule_with_limits_is_textbook_ppo_with_clip_range_half_to_ten():
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=12, spread=1.5, min_prob=0.01)
    cfg = LossConfig(rule="interval", ratio_limits=(0.5, 10.0))
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, cfg)
    ppo_logp = logp.detach().clone().requires_grad_()
    w, a = (ppo_logp - old_logp).exp(), adv[:, None]
    (-(torch.minimum(w * a, w.clamp(0.5, 10) * a) * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(grad, ppo_logp.grad, rtol=1e-12, atol=0)
    w, a = w.detach(), a.expand_as(w)
    stopped = mask & (((w < 0.5) & (a < 0)) | ((w > 10) & (a > 0)))
    assert stopped.any() and (grad[stopped] == 0).all()
    assert metrics["limit_clip_frac"] == pytest.approx((stopped.sum() / mask.sum()).item())
    assert metrics["clip_low_frac"] == metrics["clip_high_frac"] == 0  # the region admits everything


def test_ratio_limits_and_dual_clip_are_the_two_readings_of_half_to_ten():
    old_logp = torch.full((1, 6), math.log(0.05), dtype=f64)  # kl-atomic admits [0.012, 86.7] here
    w = torch.tensor([12.0, 12.0, 0.4, 0.4, 3.0, 1000.0], dtype=f64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, 1.0]], dtype=f64)
    mask = torch.ones(1, 6, dtype=torch.bool)
    logp = old_logp + w.log()[None]
    a, n = adv[0], 6
    # limits: stop what is pushed outward past them (w=12 A>0, w=0.4 A<0); the region stops w=1000 A>0
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, LossConfig(rule="kl-atomic", ratio_limits=(0.5, 10)))
    kept = torch.tensor([False, True, False, True, True, False])
    torch.testing.assert_close(grad[0], torch.where(kept, -a * w / n, 0))
    assert metrics["limit_clip_frac"] == pytest.approx(2 / 6) and metrics["clip_high_frac"] == pytest.approx(1 / 6)
    assert metrics["mu[0.01-0.1]/limit_frac"] == pytest.approx(2 / 6)
    assert metrics["mu[0.01-0.1]/clip_frac"] == pytest.approx(1 / 6)  # region clips only
    # dual clip: stops what is pulled back in past them (w=12 A<0, w=0.4 A>0)
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, LossConfig(rule="kl-atomic", dual_clip=(0.5, 10)))
    kept = torch.tensor([True, False, True, False, True, False])
    torch.testing.assert_close(grad[0], torch.where(kept, -a * w / n, 0))
    assert metrics["limit_clip_frac"] == pytest.approx(2 / 6) and metrics["clip_high_frac"] == pytest.approx(1 / 6)


@pytest.mark.parametrize("rule", ["gspo", "gmpo", "cispo", "sapo", "dcpo", "kl3"])
def test_ratio_limits_stop_outward_tokens_in_every_rule(rule):
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=13, spread=1.5, min_prob=0.2)
    delta = 0.5 if rule == "gspo" else None  # gspo's own interval is far inside the limits
    cfg = LossConfig(rule=rule, delta=delta, ratio_limits=(0.9, 1.1))
    _, grad, metrics = grad_of(logp, old_logp, adv, mask, cfg)
    _, free_grad, _ = grad_of(logp, old_logp, adv, mask, LossConfig(rule=rule, delta=delta))
    assert metrics["limit_clip_frac"] > 0
    assert not torch.equal(grad, free_grad)
    if rule not in ("gspo", "gmpo"):  # token-level: a limit-stopped token has no gradient of its own
        records = []
        policy_loss(logp, old_logp, adv, mask, cfg, records=records)
        assert (grad[mask][torch.as_tensor(records[0]["limit"])] == 0).all()


# ----------------------------------------------------------------------------- the config and the rule interface


def test_a_rule_registered_in_a_test_gets_its_flags_bounds_and_metrics_from_its_entry():
    cfg, given, _ = config.parse_args(["--rule", "sqrt_band", "--delta", "0.3", "--ratio-limits", "0.5,10"])
    assert cfg.loss.rule == "sqrt_band" and cfg.loss.delta == 0.3 and {"delta", "ratio_limits"} <= given
    for flags in (["--delta-high", "0.3"], ["--tv-half"], ["--sapo-tau-pos", "2"]):
        with pytest.raises(ValueError, match=f"{flags[0]}.*: --rule sqrt_band does not read it"):
            config.parse_args(["--rule", "sqrt_band", *flags])
    mu = torch.tensor([0.95, 0.25, 0.02], dtype=f64)
    lo, hi = ratio_bounds("sqrt_band", 0.3, mu, ratio_limits=(0.5, 10.0))
    torch.testing.assert_close(hi, (1 + 0.3 / mu.sqrt()).clamp_max(10))
    torch.testing.assert_close(lo, (1 - 0.3 / mu.sqrt()).clamp_min(0.5))
    old_logp = mu.log()[None]  # w = 1.5 pushed up: outside the band 1 +- 0.3/sqrt(mu) at mu = 0.95 only
    _, metrics = policy_loss(old_logp + math.log(1.5), old_logp, torch.ones(1), torch.ones(1, 3, dtype=torch.bool),
                             LossConfig(rule="sqrt_band", delta=0.3))  # fmt: skip
    assert metrics["clip_high_frac"] == pytest.approx(1 / 3) and metrics["mu[>0.9]/clip_frac"] == 1.0
    assert metrics["mu[0.1-0.5]/clip_frac"] == metrics["mu[0.01-0.1]/clip_frac"] == 0.0
    with pytest.raises(ValueError, match="'sqrt_band' is registered already"):
        register("sqrt_band", RULES["grpo"])


def test_every_entry_declares_settings_that_are_config_fields_and_the_config_builds():
    fields = {f.name for f in dataclasses.fields(LossConfig)}
    for name, rule in RULES.items():
        assert set(rule.settings) <= fields, name
        assert LossConfig(rule=name).delta is None or "delta" in rule.settings, name


def test_every_field_has_help_and_tuples_round_trip_through_json():
    for f in dataclasses.fields(LossConfig):
        assert f.metadata.get("help"), f.name
    cfg = LossConfig(rule="kl-atomic", ratio_limits=(0.5, 10), dual_clip=(0.5, 10), clip_cov_bounds=(0.0, 2.0))
    again = LossConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert again == cfg and again.rule == ("kl", "atomic") and again.ratio_limits == (0.5, 10.0)
    assert LossConfig(dual_clip="3").dual_clip == 3.0 and LossConfig(dual_clip="0.5,10").dual_clip == (0.5, 10.0)


def test_advantages_take_their_options_from_the_config():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    for adv_std in ("group", "batch", "none"):
        for leave_one_out in (False, True):
            cfg = LossConfig(adv_std=adv_std, leave_one_out=leave_one_out)
            expected = group_advantages(rewards, 4, std=adv_std, leave_one_out=leave_one_out)
            assert torch.equal(advantages(rewards, 4, cfg), expected)
    assert not torch.equal(advantages(rewards, 4, LossConfig(leave_one_out=True)), advantages(rewards, 4, LossConfig()))


def test_sequence_level_rules_default_to_their_aggregation_and_refuse_another():
    for rule in ("gspo", "gmpo", "sapo"):
        assert LossConfig(rule=rule).aggregation == "seq-mean-token-mean"
        assert LossConfig(rule=rule, aggregation="seq-mean-token-mean").aggregation == "seq-mean-token-mean"
    assert LossConfig(rule="atr").aggregation == "token-mean"
    assert LossConfig(rule="atr", aggregation="seq-mean-token-sum-norm").aggregation == "seq-mean-token-sum-norm"


def test_required_inputs_and_missing_or_unknown_inputs():
    kl_full_needs = {"old_hidden", "hidden", "lm_head_weight", "temperature"}
    assert required_inputs(LossConfig()) == frozenset()
    assert required_inputs(LossConfig(kl_beta=0.1)) == {"ref_logp"}
    assert required_inputs(LossConfig(rule="kl_full")) == kl_full_needs
    assert required_inputs(LossConfig(rule="kl_full", kl_beta=0.1)) == kl_full_needs | {"ref_logp"}
    assert all(name in INPUTS for name in required_inputs(LossConfig(rule="kl_full", kl_beta=0.1)))
    logp, old_logp, adv, mask = random_tokens()
    with pytest.raises(ValueError, match="needs the inputs ref_logp"):
        policy_loss(logp, old_logp, adv, mask, LossConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match="unknown inputs vocab_kl"):
        policy_loss(logp, old_logp, adv, mask, LossConfig(), vocab_kl=torch.zeros_like(logp))
    with pytest.raises(ValueError, match="hidden"):
        policy_loss(
            logp,
            old_logp,
            adv,
            mask,
            LossConfig(rule="kl_full"),
            old_hidden=torch.zeros(6, 8, 4),
            hidden=torch.zeros(6, 7, 4),
            lm_head_weight=torch.zeros(5, 4),
            temperature=1.0,
        )
    loss, _ = policy_loss(logp, old_logp, adv, mask, LossConfig(), ref_logp=old_logp)  # given, not needed: unused
    assert loss.item() == policy_loss(logp, old_logp, adv, mask, LossConfig())[0].item()


# ----------------------------------------------------------------------------- the rollout correction, entropy tokens


@pytest.mark.parametrize("rule", ["grpo", "dapo", "gspo", "cispo", "sapo", "atr", "kl-binary"])
@pytest.mark.parametrize("form", ["tis-token", "tis-seq", "mis-token", "mis-seq"])
def test_a_rollout_correction_with_equal_sampler_and_trainer_logp_changes_nothing_bit_for_bit(rule, form):
    logp, old_logp, adv, mask = random_tokens(seed=3)
    plain, plain_grad, _ = grad_of(logp, old_logp, adv, mask, LossConfig(rule=rule))
    cfg = LossConfig(rule=rule, rollout_correction=form, rollout_correction_cap=1.0)  # the tightest cap
    value, grad, metrics = grad_of(logp, old_logp, adv, mask, cfg, sampler_logp=old_logp.clone())
    assert torch.equal(value, plain) and torch.equal(grad, plain_grad)
    assert metrics["correction_weight_min"] == metrics["correction_weight_max"] == 1.0


def test_each_rollout_correction_matches_its_formula_on_a_hand_made_batch():
    # two sequences of two tokens; rho per token = old / sampler probability
    old_logp = torch.log(torch.tensor([[0.5, 0.4], [0.2, 0.9]], dtype=f64))
    rho = torch.tensor([[3.0, 0.5], [1.5, 1.2]], dtype=f64)
    sampler_logp = old_logp - rho.log()
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -2.0], dtype=f64)
    C = 2.0
    # the first sequence's product is 1.5, the second's (one token) 1.5: both under the cap
    expected = {
        "tis-token": [[2.0, 0.5], [1.5, 1.0]],
        "mis-token": [[0.0, 0.5], [1.5, 1.0]],
        "tis-seq": [[1.5, 1.5], [1.5, 1.0]],
        "mis-seq": [[1.5, 1.5], [1.5, 1.0]],
    }
    for form, weight in expected.items():
        weight = torch.tensor(weight, dtype=f64)
        cfg = LossConfig(rule="interval", rollout_correction=form, rollout_correction_cap=C)
        logp = old_logp.clone().requires_grad_()  # w = 1: grpo's objective is A * w per token
        value, metrics = policy_loss(logp, old_logp, adv, mask, cfg, sampler_logp=sampler_logp)
        value.backward()
        per_token = adv[:, None] * weight  # the objective's gradient in log p at w = 1
        assert torch.allclose(value, -(per_token * mask).sum() / mask.sum())
        assert torch.allclose(logp.grad, torch.where(mask, -per_token / mask.sum(), 0))
        assert metrics["correction_masked_frac"] == pytest.approx((weight[mask] == 0).double().mean().item())
    # a sequence over the cap: tis-seq truncates it to C, mis-seq drops it
    over = old_logp - torch.log(torch.tensor([[3.0, 1.0], [1.0, 1.0]], dtype=f64))
    for form, first in (("tis-seq", C), ("mis-seq", 0.0)):
        cfg = LossConfig(rollout_correction=form, rollout_correction_cap=C)
        logp = old_logp.clone().requires_grad_()
        policy_loss(logp, old_logp, adv, mask, cfg, sampler_logp=over)[0].backward()
        assert torch.allclose(logp.grad[0], torch.full((2,), -1.0 * first / 3, dtype=f64))


def test_the_rollout_correction_needs_the_sampler_logp_and_its_cap_is_inert_without_it():
    assert required_inputs(LossConfig(rollout_correction="tis-token")) == {"sampler_logp"}
    assert "sampler_logp" in INPUTS
    logp, old_logp, adv, mask = random_tokens()
    with pytest.raises(ValueError, match="needs the inputs sampler_logp"):
        policy_loss(logp, old_logp, adv, mask, LossConfig(rollout_correction="tis-seq"))
    with pytest.raises(ValueError, match="--rollout-correction tis: expected one of off, tis-token"):
        LossConfig(rollout_correction="tis")
    with pytest.raises(ValueError, match="--rollout-correction-cap 0.5: must be >= 1"):
        LossConfig(rollout_correction="tis-token", rollout_correction_cap=0.5)
    from loss import inert_settings

    assert "rollout_correction_cap" in inert_settings(LossConfig())
    assert "rollout_correction_cap" not in inert_settings(LossConfig(rollout_correction="mis-token"))


def test_top_entropy_quantile_keeps_the_gradient_of_the_top_tokens_only():
    logp, old_logp, adv, mask = random_tokens(B=2, T=4, seed=5)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    entropy = torch.tensor([[0.1, 2.0, 0.5, 3.0], [1.0, 0.2, 9.0, 9.0]], dtype=f64)  # 9.0s are off the mask
    # six masked entropies 0.1 0.2 0.5 1.0 2.0 3.0; the top half: 1.0, 2.0, 3.0
    top = torch.tensor([[False, True, False, True], [True, False, False, False]])
    cfg = LossConfig(rule="interval", top_entropy_quantile=0.5)  # no clip: every token has a gradient
    assert required_inputs(cfg) == {"entropy"}
    value, grad, metrics = grad_of(logp, old_logp, adv, mask, cfg, entropy=entropy)
    _, full_grad, _ = grad_of(logp, old_logp, adv, mask, LossConfig(rule="interval"))
    assert torch.equal(grad[top], full_grad[top]) and (grad[~top] == 0).all() and (full_grad[top] != 0).all()
    assert metrics["entropy_selected_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"--top-entropy-quantile 0.0: must be in \(0, 1\]"):
        LossConfig(top_entropy_quantile=0.0)


def test_mismatch_metrics_against_hand_computation():
    from loss import mismatch

    sampler = torch.log(torch.tensor([[0.5, 0.5, 0.1]], dtype=f64))
    trainer = torch.log(torch.tensor([[0.5, 0.25, 0.3]], dtype=f64))
    mask = torch.tensor([[True, True, True]])
    r = torch.tensor([1.0, 0.5, 3.0], dtype=f64)
    stats = mismatch(sampler, trainer, mask)
    assert stats["mismatch/abs_mean"] == pytest.approx(r.log().abs().mean().item())
    assert stats["mismatch/abs_max"] == pytest.approx(math.log(3))
    assert stats["mismatch/k3"] == pytest.approx((r - 1 - r.log()).mean().item())
    assert stats["mismatch/out_frac"] == pytest.approx(1 / 3)  # 0.5 is on the edge, inside; 3 outside
    assert mismatch(sampler, sampler, mask) == {
        "mismatch/abs_mean": 0.0,
        "mismatch/abs_max": 0.0,
        "mismatch/k3": 0.0,
        "mismatch/out_frac": 0.0,
    }
