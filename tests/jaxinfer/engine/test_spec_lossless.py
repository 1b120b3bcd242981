"""Speculative decoding with a separate draft model ("draft_model"), end to end through `Engine`.

Models: the tiny random Llama-3 target (tests/data/tiny_llama3, 2 layers, 128 ids) and a draft written next to it:
the target's first layer with its embeddings, final norm and LM head, every weight perturbed by Gaussian noise of
10% of its standard deviation (seeded). A fully independent random draft would almost never share the target's
top-k tokens (acceptance ~ 0); this one agrees with the target part of the time, so that drafts are both accepted
and rejected, while its distributions q differ from the target's p everywhere.

What is tested:
- Lossless sampling (`test_sampling_is_lossless`): thousands of seeded requests of one prompt run in lock step in
  one engine batch; the joint distribution of their first tokens must be the target's (chi-square), the
  acceptance counts must match the theory (sums over tokens of min(p, q)), and the engine's spec counters must
  agree with what the outputs show. `test_chi_square_has_power` shows that the same test catches wrong rules.
- Greedy: identical tokens and logprobs to speculation off (k = 1 and 3, next to sampling requests); with the
  target itself as the draft, every draft is accepted (the draft's own KV cache stays in step with the target's
  through chunked prefill, page boundaries, prefix-cache hits and a copy-on-write page); a draft that outputs NaN
  changes no greedy output and fails no request.
- Seeds: seeded sampling with speculation gives the same tokens every time, whatever the batch.
- Configuration errors: a draft with another vocabulary, and "draft_model" with tensor / expert parallelism.

Reference distributions come from engines with speculation off (the target's, and one serving the draft folder as
its model): the raw top-20 log-probabilities of a 1-token request at a context, with the top_k truncation the
sampler applies (temperature 1 and no other processing, so the truncated distribution is the softmax over the
top_k raw logprobs).

Every chi-square test here is a goodness-of-fit test at significance ALPHA = 0.001 (scipy.stats.chisquare); count
checks allow SIGMAS = 4 standard deviations. Seeds are fixed, so every test is deterministic.

Runtime is mostly XLA compiles (a few seconds per step shape on CPU), so the engines are shared and the batches
are shaped to reuse compiled steps: reference requests go in batches of exactly REF_BATCH, both lossless cases run
on one engine, the k = 1 and k = 3 engines have the same cache (their plain steps compile once, through the
persistent compilation cache), and the NaN-draft engine reuses all of the k = 3 engine's steps.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import tokenizers
from safetensors.numpy import load_file, save_file
from tokenizers import models, pre_tokenizers

from jaxinfer import SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.outputs import Logprob, RequestOutput
from tests.jaxinfer.engine.tiny_model import FIRST_WORD_ID, make_tiny_model_dir, random_prompts

ALPHA = 0.001  # significance of every chi-square test in this module
SIGMAS = 4  # tolerance of count checks, in standard deviations
N = 2048  # seeded requests per lossless-sampling case, all in one engine batch
PROMPT = [5, 17, 33, 9, 71, 20]  # word ids; the prompt of every lossless-sampling request
PAGE_SIZE = 8
MAX_MODEL_LEN = 64
REF_BATCH = 32  # reference requests per batch (padded by repeating one): one compiled prefill shape
MAX_STEP_TOKENS = 1 << 16  # rule 1 of the speculation policy never turns drafts off here
DRAFT_NOISE = 0.1

Context = tuple[int, ...]  # output tokens after PROMPT
Dist = dict[int, float]  # token id -> probability


# ---------------------------------------------------------------------------------------------------------------
# Models and engines


def make_draft_dir(root: Path, *, num_layers: int = 1, noise: float = DRAFT_NOISE, seed: int = 0,
                   vocab_size: int | None = None, tokenizer_words: int | None = None) -> Path:
    """An HF folder of a draft derived from the tiny target (module docstring), with the target's tokenizer.

    Args:
      num_layers: the target layers kept (from the first).
      noise: Gaussian noise added to every weight, as a fraction of that weight's standard deviation.
      vocab_size: another logits width (embedding and LM head rows cut, or padded with random rows).
      tokenizer_words: another tokenizer: word-level over this many ids instead of the target's 128.
    """
    root = make_tiny_model_dir(root)
    weights = load_file(str(root / "model.safetensors"))
    config = json.loads((root / "config.json").read_text())
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in weights.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        w = w + noise * w.std() * rng.standard_normal(w.shape)
        if vocab_size is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
            extra = rng.standard_normal((max(vocab_size - w.shape[0], 0), w.shape[1])) * w.std()
            w = np.concatenate([w, extra])[:vocab_size]
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    config["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (root / "config.json").write_text(json.dumps(config))
    save_file(out, str(root / "model.safetensors"))
    if tokenizer_words is not None:
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(FIRST_WORD_ID, tokenizer_words)}
        tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tk.add_special_tokens(["<unk>", "<s>", "</s>"])
        tk.save(str(root / "tokenizer.json"))
    return root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("spec_lossless")
    return {"target": make_tiny_model_dir(tmp / "target"), "draft": make_draft_dir(tmp / "draft")}


def _config(model: Path, **kwargs) -> EngineConfig:
    base = dict(model=str(model), warmup=False, page_size=PAGE_SIZE, max_model_len=MAX_MODEL_LEN,
                max_num_seqs=REF_BATCH, max_num_batched_tokens=512, kv_cache_memory_bytes=1 << 22)
    return EngineConfig.create(**(base | kwargs))


def _draft_spec(model: Path, k: int) -> dict:
    """A "draft_model" config whose policy gives every decoding sequence its k drafts (as far as max_tokens and
    the step's budget allow): no batch-size limit, and acceptance never turns drafts off."""
    return dict(method="draft_model", model=str(model), num_speculative_tokens=k, max_step_tokens=MAX_STEP_TOKENS,
                min_acceptance_rate=0.0)


def _spec_config(dirs: dict[str, Path], k: int) -> EngineConfig:
    """Room for N requests in lock step: every prompt prefills in the first step, every decode gets its drafts."""
    return _config(dirs["target"], max_num_seqs=N, max_num_batched_tokens=N * len(PROMPT),
                   kv_cache_memory_bytes=1 << 25, speculative_config=_draft_spec(dirs["draft"], k))


@pytest.fixture(scope="module")
def target_off(dirs) -> Engine:
    """The target with speculation off: reference distributions and greedy references."""
    return Engine(_config(dirs["target"]))


@pytest.fixture(scope="module")
def draft_off(dirs) -> Engine:
    """The draft folder served as a model of its own (speculation off): the draft's reference distributions."""
    return Engine(_config(dirs["draft"]))


@pytest.fixture(scope="module")
def spec1(dirs) -> Engine:
    return Engine(_spec_config(dirs, 1))


@pytest.fixture(scope="module")
def spec3(dirs) -> Engine:
    return Engine(_spec_config(dirs, 3))


# ---------------------------------------------------------------------------------------------------------------
# Running requests


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    deltas: list[list[int]]  # the new token ids of each step that gave the sequence some
    logprobs: list[dict[int, Logprob]] | None
    num_cached_tokens: int  # prompt tokens found in the prefix cache


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[Completion], dict]:
    """Adds the requests (n = 1 each), steps to the end; returns their completions in order and the change of the
    engine's integer spec_* counters."""
    before = engine.stats()
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    deltas: dict[str, list[list[int]]] = {rid: [] for rid in ids}
    final: dict[str, RequestOutput] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            (c,) = out.outputs
            assert c.error is None, c.error
            if c.delta_token_ids:
                deltas[out.request_id].append(list(c.delta_token_ids))
            if out.finished:
                final[out.request_id] = out
    else:
        raise AssertionError("the engine did not finish its requests")
    after = engine.stats()
    spec = {k: after[k] - before[k] for k in after if k.startswith("spec_") and isinstance(after[k], int)}
    results = [Completion(list(final[rid].outputs[0].token_ids), deltas[rid], final[rid].outputs[0].logprobs,
                          final[rid].num_cached_tokens) for rid in ids]
    for r in results:
        assert sum(r.deltas, []) == r.token_ids
    return results, spec


def top_k_distributions(engine: Engine, contexts: list[Context], top_k: int) -> list[Dist]:
    """The model's next-token distribution after PROMPT + each context, truncated to its top_k tokens as the
    sampler does at temperature 1, from the raw top-20 logprobs of 1-token requests (speculation off)."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20, ignore_eos=True)
    out = []
    for i in range(0, len(contexts), REF_BATCH):
        batch = contexts[i : i + REF_BATCH]
        padded = batch + [batch[-1]] * (REF_BATCH - len(batch))
        results, spec = run(engine, [(PROMPT + list(c), params) for c in padded])
        assert not any(spec.values())
        for r in results[: len(batch)]:
            ranked = sorted(((t, e.logprob) for t, e in r.logprobs[0].items()), key=lambda kv: -kv[1])
            # top_k must be a clear cut, so that the engine's truncation and this one keep the same tokens
            assert ranked[top_k - 1][1] - ranked[top_k][1] > 1e-3, ranked[: top_k + 1]
            x = np.array([v for _, v in ranked[:top_k]], np.float64)
            prob = np.exp(x - x.max())
            out.append(dict(zip([t for t, _ in ranked[:top_k]], (prob / prob.sum()).tolist())))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The theory: exact distributions of the first tokens and of the accept counts


@dataclasses.dataclass(frozen=True)
class Case:
    """Requests of PROMPT sampled at temperature 1 with top_k, max_tokens long, with k drafts per step (the
    scheduler caps a step's drafts at max_tokens - outputs - 1, so k = 3 drafts 1 or 2 tokens here)."""

    k: int
    max_tokens: int
    top_k: int

    @property
    def depth(self) -> int:
        """Leading output tokens whose joint distribution is tested: all but the last (see the lossless test)."""
        return self.max_tokens - 1

    def drafts(self, num_outputs: int) -> int:
        """Drafts of a decode step after num_outputs output tokens (0: a plain decode)."""
        return max(0, min(self.k, self.max_tokens - num_outputs - 1))


CASES = [Case(k=3, max_tokens=3, top_k=4), Case(k=3, max_tokens=4, top_k=3)]


@dataclasses.dataclass
class Tree:
    """Truncated next-token distributions of the target (p) and of the draft (q) at every context the first
    `depth` output tokens can pass through (q only where the draft proposes: after the first output token)."""

    p: dict[Context, Dist]
    q: dict[Context, Dist]
    depth: int

    def paths(self) -> dict[Context, float]:
        """Joint probability of each possible run of the first `depth` output tokens under the target alone."""
        out = {(): 1.0}
        for _ in range(self.depth):
            out = {c + (t,): f * pt for c, f in out.items() for t, pt in self.p[c].items()}
        return out

    def overlap(self, c: Context, x: int) -> float:
        """min(p(x), q(x)) at context c: the probability that the draft proposes x there and x is accepted."""
        return min(self.p[c].get(x, 0.0), self.q[c].get(x, 0.0))

    def accept_at_least(self, c: Context, j: int) -> float:
        """P(the first j drafts of a block drafted at context c are all accepted): the sum over draft runs
        x1..xj of prod_i min(p, q)(x_i | c + x_<i) (draft x is proposed with probability q(x) and then accepted
        with probability min(1, p(x)/q(x)))."""
        if j == 0:
            return 1.0
        return sum(self.overlap(c, x) * self.accept_at_least(c + (x,), j - 1) for x in self.p[c]
                   if self.overlap(c, x) > 0)


@pytest.fixture(scope="module")
def trees(target_off, draft_off) -> dict[Case, Tree]:
    """Each case's `Tree`, from the reference engines."""
    out = {}
    for case in CASES:
        p: dict[Context, Dist] = {}
        level: list[Context] = [()]
        for _ in range(case.depth):
            p.update(zip(level, top_k_distributions(target_off, level, case.top_k)))
            level = [c + (t,) for c in level for t in p[c]]
        drafted = [c for c in p if c]  # the prefill samples the first output token; drafting starts after it
        out[case] = Tree(p=p, q=dict(zip(drafted, top_k_distributions(draft_off, drafted, case.top_k))),
                         depth=case.depth)
    return out


AcceptRule = Callable[[Dist, Dist, int], float]  # (p, q, draft x) -> probability that x is accepted
ResidualRule = Callable[[Dist, Dist], Dist]  # (p, q) -> distribution of the token emitted after a rejection


def accept_min_ratio(p: Dist, q: Dist, x: int) -> float:
    return min(1.0, p.get(x, 0.0) / q[x])


def residual_max(p: Dist, q: Dist) -> Dist:
    r = {y: max(0.0, py - q.get(y, 0.0)) for y, py in p.items()}
    mass = sum(r.values())
    return {y: v / mass for y, v in r.items()} if mass > 0 else dict(p)


def predicted_joint(tree: Tree, case: Case, accept: AcceptRule = accept_min_ratio,
                    residual: ResidualRule = residual_max) -> dict[Context, float]:
    """The joint distribution of the first `depth` output tokens that the engine's process gives under a
    verification rule: the prefill samples token 1 from p; every later step drafts `case.drafts(outputs)` tokens
    (none: a plain decode from p); draft x ~ q is accepted with probability accept(p, q, x); the first rejection
    emits a token from residual(p, q) and ends the step; a block accepted to its end emits a bonus token from p.
    With the true rule (the defaults) this is the target's joint, `Tree.paths`."""
    out: dict[Context, float] = collections.defaultdict(float)

    def step(c: Context, w: float) -> None:
        if len(c) == case.depth:
            out[c] += w
        elif c and case.drafts(len(c)):
            block(c, case.drafts(len(c)), w)
        else:
            for y, py in tree.p[c].items():
                step(c + (y,), w * py)

    def block(c: Context, drafts_left: int, w: float) -> None:
        if len(c) == case.depth:
            out[c] += w
            return
        if drafts_left == 0:  # every draft accepted: the bonus token
            for y, py in tree.p[c].items():
                step(c + (y,), w * py)
            return
        rejected = 0.0
        for x, qx in tree.q[c].items():
            a = accept(tree.p[c], tree.q[c], x)
            if a > 0:
                assert x in tree.p[c], "a rule that accepts tokens outside the target's support"
                block(c + (x,), drafts_left - 1, w * qx * a)
            rejected += qx * (1 - a)
        if rejected > 0:
            for y, ry in residual(tree.p[c], tree.q[c]).items():
                if ry > 0:
                    step(c + (y,), w * rejected * ry)

    step((), 1.0)
    return dict(out)


def chi_square_power(expected: np.ndarray, alternative: np.ndarray, n: int) -> float:
    """Power of the chi-square test at ALPHA over n samples whose cells follow `alternative` instead of
    `expected` (noncentral chi-square approximation)."""
    dof = len(expected) - 1
    noncentrality = n * np.sum((alternative - expected) ** 2 / expected)
    return float(scipy.stats.ncx2.sf(scipy.stats.chi2.isf(ALPHA, dof), dof, noncentrality))


# ---------------------------------------------------------------------------------------------------------------
# Lossless sampling


@dataclasses.dataclass
class Verification:
    context: Context  # output tokens before the verify block
    num_drafts: int
    num_accepted: int
    emitted: list[int]


def verifications(case: Case, result: Completion) -> list[Verification]:
    """The verify steps of a request, read off its per-step deltas: the step after the first `done` output
    tokens drafts case.drafts(done) tokens and emits num_accepted + 1."""
    out, done = [], 0
    for s, delta in enumerate(result.deltas):
        drafts = 0 if s == 0 else case.drafts(done)  # step 0 is the prefill's sample
        assert 1 <= len(delta) <= drafts + 1, (s, delta, drafts)
        if drafts:
            out.append(Verification(tuple(result.token_ids[:done]), drafts, len(delta) - 1, delta))
        done += len(delta)
    assert done == case.max_tokens
    return out


def _case_id(case: Case) -> str:
    return f"k{case.k}-max_tokens{case.max_tokens}-top_k{case.top_k}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_sampling_is_lossless(case: Case, trees, spec3):
    """With a draft that disagrees with the target, the sampled tokens follow the target's distribution.

    N requests of PROMPT (temperature 1, top_k, distinct seeds, max_tokens) run in one batch, in lock step:
      step 1  prefills every prompt and samples output token 1 (y1) from p(. | PROMPT): no draft yet;
      step 2  drafts d = max_tokens - 2 tokens (1 or 2) with the draft model from y1 (q(. | y1), its own KV cache
              filled by the prefill) and verifies them: draft j is accepted with probability min(1, p/q); the
              first rejected position emits a sample from max(0, p - q) (renormalised) instead. So output token 2
              is always either an accepted draft or a residual sample: the rejection rule is what is tested, and
              with d = 2 also a rejection after an acceptance (token 3) and the draft's second step;
      step 3+ requests that emitted fewer tokens decode again, with drafts while max_tokens leaves room for one
              (with max_tokens 4, token 3 after a rejection at step 2 is again a verified draft or a residual).
    Tested: the joint distribution of the first depth = max_tokens - 1 output tokens (the last token can be a
    bonus or a plain decode, which `sample` makes). Under the target it is prod_t p(y_t | y_<t) over the tree of
    top_k continuations (`Tree.paths`): losslessness means every output token follows the target's conditional
    distribution given the tokens before it, whether an accept, a residual, a bonus or a plain decode made it.
    Tokens 2+ depend on token 1, so the joint is tested rather than a marginal: a chi-square goodness-of-fit test
    at ALPHA = 0.001 over its top_k ** depth cells (16 and 27 here; every expected count >= 5 is checked).
    `test_chi_square_has_power` shows the test would catch wrong rules. `predicted_joint`, a model of the
    engine's steps, must reproduce `Tree.paths` under the true rule (a check of that model).

    Acceptance: the verify steps are read from each request's per-step deltas (a verify of d drafts emits
    num_accepted + 1 tokens). Given the context c of a verify, P(num_accepted >= j) = the sum over x1..xj of
    prod min(p, q)(x_i | c, x_<i) (`Tree.accept_at_least`; j = 1: sum_x min(p(x), q(x))). For each j, the number
    of verifies with num_accepted >= j must lie within SIGMAS = 4 standard deviations (sqrt of the sum of
    P(1 - P): independent Bernoulli trials given the contexts) of the sum of those probabilities. q comes from the
    draft folder served alone, so this also checks that the engine's draft sees the context the target sees (its
    own KV cache is in step). Both acceptances and rejections must occur, every accepted draft must lie in the
    draft's top_k, and the engine's spec counters must equal the drafts and acceptances the outputs show.
    """
    tree = trees[case]
    paths = tree.paths()
    cells = sorted(paths)
    expected = np.array([paths[c] for c in cells])
    assert len(cells) == case.top_k ** case.depth and math.isclose(expected.sum(), 1.0, rel_tol=1e-9)
    assert (expected * N >= 5).all(), "too few samples for the chi-square approximation"
    predicted = predicted_joint(tree, case)
    np.testing.assert_allclose([predicted.get(c, 0.0) for c in cells], expected, rtol=1e-9, atol=1e-12)
    # the premise: the draft disagrees with the target where it drafts, though not everywhere
    alphas = [sum(tree.overlap(c, x) for x in tree.p[c]) for c in tree.q]
    assert max(alphas) < 0.9 and np.mean(alphas) > 0.1, alphas

    params = [SamplingParams(temperature=1.0, top_k=case.top_k, max_tokens=case.max_tokens, ignore_eos=True,
                             seed=10_000 * case.max_tokens + i) for i in range(N)]
    results, spec = run(spec3, [(PROMPT, p) for p in params])

    # 1. the joint of the first `depth` tokens is the target's
    observed = [tuple(r.token_ids[: case.depth]) for r in results]
    outside = [o for o in observed if o not in paths]
    assert not outside, f"{len(outside)} outputs outside the target's top_k support, e.g. {outside[:3]}"
    index = {c: i for i, c in enumerate(cells)}
    counts = np.bincount([index[o] for o in observed], minlength=len(cells))
    pvalue = scipy.stats.chisquare(counts, expected * N).pvalue
    assert pvalue > ALPHA, (pvalue, counts.tolist(), (expected * N).round(1).tolist())

    # 2. acceptance as the theory says, and the engine's counters agree
    events = [v for r in results for v in verifications(case, r)]
    assert spec["spec_draft_tokens"] == sum(v.num_drafts for v in events)
    assert spec["spec_accepted_tokens"] == sum(v.num_accepted for v in events)
    assert spec["spec_verify_rows"] == len(events)
    for v in events:  # accepted drafts: the emitted tokens before the last; each lies in q's support
        context = v.context
        for x in v.emitted[:-1]:
            assert tree.q[context].get(x, 0.0) > 0, (v, tree.q[context])
            context += (x,)
    assert max(v.num_drafts for v in events) == case.drafts(1)
    for j in range(1, case.drafts(1) + 1):
        tested = [v for v in events if v.num_drafts >= j]
        probs = np.array([tree.accept_at_least(v.context, j) for v in tested])
        hits = sum(v.num_accepted >= j for v in tested)
        tolerance = SIGMAS * math.sqrt(float(np.sum(probs * (1 - probs))))
        assert abs(hits - probs.sum()) <= tolerance, (j, hits, probs.sum(), tolerance)
        assert 0 < hits < len(tested), (j, hits, len(tested))  # both acceptances and rejections happened


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_chi_square_has_power(case: Case, trees):
    """The lossless test's chi-square (same cells, N requests) catches each of these wrong rules with
    probability > 0.99 (noncentral chi-square approximation, on `predicted_joint` under the rule):
      - residual from p: a rejection resamples from p instead of max(0, p - q);
      - accept ignoring q: draft x is accepted with probability p(x) instead of min(1, p(x)/q(x)).
    Both keep every token in the target's support, so only the chi-square can see them."""
    tree = trees[case]
    cells = sorted(tree.paths())
    expected = np.array([tree.paths()[c] for c in cells])
    wrong_rules = {"residual from p": (accept_min_ratio, lambda p, q: dict(p)),
                   "accept ignoring q": (lambda p, q, x: p.get(x, 0.0), residual_max)}
    for name, (accept, residual) in wrong_rules.items():
        joint = predicted_joint(tree, case, accept, residual)
        assert set(joint) <= set(cells) and math.isclose(sum(joint.values()), 1.0, rel_tol=1e-9), name
        power = chi_square_power(expected, np.array([joint.get(c, 0.0) for c in cells]), N)
        assert power > 0.99, (name, power)


# ---------------------------------------------------------------------------------------------------------------
# Greedy and seeds


# Prompts crossing a page boundary (8 tokens); the last fills exactly 2 pages, so that when it runs again its
# whole prompt is a prefix-cache hit and its last token is recomputed into a copy-on-write page.
GREEDY_PROMPTS = random_prompts(3, seed=31, min_len=9, max_len=15) + random_prompts(1, seed=32, min_len=16,
                                                                                     max_len=16)
GREEDY_MAX_TOKENS = 16


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=GREEDY_MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def greedy_reference(target_off) -> list[Completion]:
    """GREEDY_PROMPTS decoded greedily with speculation off (distinct outputs: the comparisons have teeth)."""
    results, _ = run(target_off, [(p, _greedy()) for p in GREEDY_PROMPTS])
    assert len({tuple(r.token_ids) for r in results}) == len(results)
    return results


def assert_same_greedy(results: list[Completion], reference: list[Completion]) -> None:
    """The same tokens, and per token the same top-2 raw logprobs (up to float rounding: the target computed
    them in verify blocks of several tokens instead of one token at a time), ranks and decoded tokens."""
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    for r, ref in zip(results, reference):
        assert len(r.logprobs) == len(ref.logprobs) == GREEDY_MAX_TOKENS
        for got, want in zip(r.logprobs, ref.logprobs):
            assert list(got) == list(want)
            np.testing.assert_allclose([got[t].logprob for t in want], [e.logprob for e in want.values()], rtol=0,
                                       atol=1e-4)
            assert [(e.rank, e.decoded_token) for e in got.values()] == \
                [(e.rank, e.decoded_token) for e in want.values()]


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=GREEDY_MAX_TOKENS, ignore_eos=True, seed=seed)


# Two greedy requests and two seeded ones of the first prompt (4 rows: the steps' batch buckets stay small).
NUM_MIXED_GREEDY = 2
MIXED = [(p, _greedy()) for p in GREEDY_PROMPTS[:NUM_MIXED_GREEDY]] + \
        [(GREEDY_PROMPTS[0], _seeded(7)), (GREEDY_PROMPTS[0], _seeded(70))]


@pytest.fixture(scope="module")
def mixed_run(spec1, spec3) -> Callable[[int], tuple[list[Completion], dict]]:
    """MIXED in one batch with k = 1 or 3 (run once per k)."""
    return functools.cache(lambda k: run(spec1 if k == 1 else spec3, MIXED))


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_matches_speculation_off(k, mixed_run, greedy_reference):
    """Greedy decoding with the draft model emits exactly the tokens of greedy decoding without speculation,
    through accepted and rejected drafts alike, next to sampling requests in the same batch."""
    results, spec = mixed_run(k)
    assert_same_greedy(results[:NUM_MIXED_GREEDY], greedy_reference[:NUM_MIXED_GREEDY])
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"], spec  # both outcomes were verified
    if k == 3:
        assert any(len(d) > 2 for r in results for d in r.deltas)  # a step emitted 2+ accepted drafts


def test_greedy_ranks_match_speculation_off(spec3, target_off):
    """The rank of each emitted token (computed in verify, per position) equals the rank decoding without
    speculation computes. A repetition penalty moves greedy tokens off the raw argmax (ranks > 1), and logprobs=0
    leaves only the sampled token's entry, whose rank is the device's."""
    params = SamplingParams(temperature=0, max_tokens=GREEDY_MAX_TOKENS, ignore_eos=True, logprobs=0,
                            repetition_penalty=2.0)
    requests = [(p, params) for p in GREEDY_PROMPTS]
    results, spec = run(spec3, requests)
    reference, _ = run(target_off, requests)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    ranks = [[e[t].rank for t, e in zip(r.token_ids, r.logprobs)] for r in results]
    assert ranks == [[e[t].rank for t, e in zip(r.token_ids, r.logprobs)] for r in reference]
    assert all(len(e) == 1 for r in results for e in r.logprobs)
    assert max(max(r) for r in ranks) > 1 and min(min(r) for r in ranks) >= 1
    assert spec["spec_accepted_tokens"] > 0, spec


def test_greedy_with_the_target_as_draft_accepts_every_draft(dirs, greedy_reference):
    """The target's own folder as the draft model: every greedy draft equals the target's argmax, so every draft
    is accepted. That holds only if the draft's KV cache holds the same K/V as the target's at every position it
    reads: here through chunked prefill (a 16-token step budget for 4 prompts of 9-16 tokens, decodes and
    prefill chunks in one step), blocks crossing page boundaries, and prefix-cache hits (the prompts run twice;
    one is a whole-prompt hit whose last token is recomputed into a copy-on-write page)."""
    engine = Engine(_config(dirs["target"], max_num_batched_tokens=16,
                            speculative_config=_draft_spec(dirs["target"], 3)))
    for attempt in range(2):
        results, spec = run(engine, [(p, _greedy()) for p in GREEDY_PROMPTS])
        assert_same_greedy(results, greedy_reference)
        assert spec["spec_draft_tokens"] > 0
        assert spec["spec_accepted_tokens"] == spec["spec_draft_tokens"], (attempt, spec)
    assert all(r.num_cached_tokens > 0 for r in results)  # the second run found every prompt's full pages
    # the 16-token prompt was cached whole: only its last token was recomputed (into a copy-on-write page)
    assert results[-1].num_cached_tokens == len(GREEDY_PROMPTS[-1]) - 1


def test_draft_producing_nan_changes_no_greedy_output(dirs, tmp_path, greedy_reference):
    """A draft model whose outputs are all NaN (a NaN weight) proposes garbage with NaN probabilities: the
    target rejects it, no request fails, greedy rows keep their tokens and seeded rows produce max_tokens tokens.
    (Same engine shapes as the k = 3 engine, so its compiled steps are reused.)"""
    draft = make_draft_dir(tmp_path / "nan_draft")
    weights = load_file(str(draft / "model.safetensors"))
    weights["model.layers.0.mlp.down_proj.weight"][:] = np.nan
    save_file(weights, str(draft / "model.safetensors"))
    nan_spec = EngineConfig.normalize("speculative_config", _draft_spec(draft, 3))
    config = dataclasses.replace(_spec_config(dirs, 3), speculative_config=nan_spec)
    results, spec = run(Engine(config), MIXED)
    assert_same_greedy(results[:NUM_MIXED_GREEDY], greedy_reference[:NUM_MIXED_GREEDY])
    assert all(len(r.token_ids) == GREEDY_MAX_TOKENS for r in results)
    assert spec["spec_draft_tokens"] > 0


def test_seeded_sampling_is_reproducible(mixed_run, spec3):
    """With the draft model (k = 3), a seeded request gives the same tokens every time: in the batch run again
    in reverse order, and alone; another seed gives other tokens."""
    results, _ = mixed_run(3)
    tokens = [r.token_ids for r in results]
    seven, seventy = NUM_MIXED_GREEDY, NUM_MIXED_GREEDY + 1
    assert tokens[seven] != tokens[seventy]  # same prompt, another seed
    again, spec = run(spec3, MIXED[::-1])
    assert [r.token_ids for r in again] == tokens[::-1]
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"], spec
    alone, _ = run(spec3, [MIXED[seven]])
    assert alone[0].token_ids == tokens[seven]


# ---------------------------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize("what", ["logits", "tokenizer"])
def test_draft_with_another_vocabulary_is_rejected(what, dirs, tmp_path):
    """A draft whose logits width (160) or tokenizer (100 ids) differs from the target's 128: a ValueError naming
    the vocabularies."""
    draft = make_draft_dir(tmp_path / "draft", **({"vocab_size": 160} if what == "logits" else
                                                  {"tokenizer_words": 100}))
    with pytest.raises(ValueError, match="vocabulary") as e:
        Engine(_config(dirs["target"], speculative_config=_draft_spec(draft, 2)))
    assert ("160" if what == "logits" else "100") in str(e.value) and "128" in str(e.value)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"expert_parallel_size": 2}])
def test_draft_model_runs_on_one_device(parallel, dirs):
    with pytest.raises(ValueError, match="draft_model"):
        Engine(_config(dirs["target"], speculative_config=_draft_spec(dirs["draft"], 2), **parallel))
