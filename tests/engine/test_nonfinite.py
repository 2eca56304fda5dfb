"""NaN and overflow from the models (issue 31, item 5): a target or a draft whose logits are NaN or +inf (an
fp16 overflow) stops ``generate`` with one clear error naming the model, the cycle and the position, never a
token chosen from them; the engine is usable afterwards.

On the CPU the ops refuse such logits mid-cycle and the loop names the model from the cycle's flags; on a GPU the
ops only record the refusal (check=False) and the flags, read with the accepted tokens, raise the error.  The
second path is run here too, by letting the acceptance op see the logits with the non-finite values replaced
(as a GPU's deferred check would let it): the error must still come, before that cycle's tokens are streamed.
.ci/gpu's ``engine`` phase runs this file on a GPU."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _doubles import OracleDraft
from _models import (
    DEVICE,
    THRESHOLDS,
    eagle3_head,
    prompts,
    reference_greedy,
    tiny_target,
)

from heterospec import HeteroSpec, NonFiniteLogitsError, Policy, ops
from heterospec.engine import cycle as cycle_mod
from heterospec.models import cpu_decoder

NEW = 24
GRAPHS = [False, "emulate"] + ([True] if DEVICE.type == "cuda" else [])   # True: real CUDA graphs
POLICIES = {
    "ar": lambda: Policy.autoregressive(),
    "eagle3": lambda: Policy.static(depth=3, top_k=3, total_tokens=12),
    "heterospec": lambda: Policy.paper(3, 3, 12, thresholds=THRESHOLDS),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_target("llama")
    return model, eagle3_head(model, tmp_path_factory.mktemp("head"))


class Poison:
    """A forward hook on a module's output logits: from its ``at``-th call on (1-based), sets one entry of
    request ``row``'s first position to ``value``.  The count and the switch live on the device and the hook
    uses no host value, so a CUDA graph recorded with the hook on replays it: a hook added after the recording,
    or a Python counter, is never run by a replay (the third GPU window).  ``at=None``: off; :meth:`arm`
    restarts the count."""

    OFF = 2**62

    def __init__(self, module, at, value=float("nan"), row=0):
        device = next(module.parameters()).device
        self.calls = torch.zeros((), dtype=torch.long, device=device)
        self.at = torch.full((), self.OFF, dtype=torch.long, device=device)
        self.value, self.row = value, row
        self.arm(at)
        self.handle = module.register_forward_hook(self)

    def arm(self, at):
        self.calls.zero_()
        self.at.fill_(self.OFF if at is None else at)

    def __call__(self, module, args, out):
        self.calls.add_(1)
        if out.shape[0] <= self.row:     # a forward of fewer requests (a batch's prompts are prefilled one by one)
            return out
        out = out.clone()
        entry = out[self.row, 0, 5]
        out[self.row, 0, 5] = torch.where(self.calls >= self.at, torch.full_like(entry, self.value), entry)
        return out

    def remove(self):
        self.handle.remove()


class Streamed:
    def __init__(self):
        self.tokens = []

    def put(self, t):
        self.tokens += t.view(-1).tolist()

    def end(self):
        pass


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("graphs", GRAPHS)
def test_target_nan_or_inf_is_a_clear_error_naming_the_target_and_the_cycle(pair, name, value, graphs):
    model, head = pair
    p = prompts(2)[1]
    want = reference_greedy(model, p, NEW)[0, p.shape[1]:].tolist()
    poison = Poison(model.lm_head, at=None)     # on before the steps are recorded, so replays run it
    try:
        with HeteroSpec(model, None if name == "ar" else head, POLICIES[name](), cuda_graphs=graphs) as hs:
            hs.generate(p, max_new_tokens=NEW)  # records the steps (cuda_graphs), which run the target too
            poison.arm(4)                       # call 1: the prefill; call c + 1: cycle c's verification
            out = Streamed()
            with pytest.raises(NonFiniteLogitsError) as e:
                hs.generate(p, max_new_tokens=NEW, streamer=out)
            poison.arm(None)
            msg = str(e.value)
            assert "\n" not in msg and "target model LlamaForCausalLM (float32)" in msg and "cycle 3" in msg, msg
            assert "non-finite logits" in msg and "position" in msg
            # what was streamed before the error is the target's own greedy output, and nothing of cycle 3
            streamed = out.tokens[p.shape[1]:]
            assert streamed == want[:len(streamed)]
            # the engine is usable afterwards: the same call gives the target's greedy output
            seq, _ = hs.generate(p, max_new_tokens=NEW)
            assert seq[0, p.shape[1]:].tolist() == want
    finally:
        poison.remove()


def test_nan_in_the_prompts_forward_is_named_as_such(pair):
    model, head = pair
    with HeteroSpec(model, head, POLICIES["eagle3"](), cuda_graphs=False) as hs:
        poison = Poison(model.lm_head, at=1)
        try:
            with pytest.raises(NonFiniteLogitsError, match="target model .* in the prefill, at position"):
                hs.generate(prompts(1)[0], max_new_tokens=8)
        finally:
            poison.remove()


@pytest.mark.parametrize("sample", [False, True])
def test_the_flags_alone_stop_the_cycle_when_the_ops_do_not_raise(pair, monkeypatch, sample):
    """The GPU path: acceptance sees the logits without the NaN (a deferred device-side check does not raise in
    the cycle); the flags read with the accepted tokens still raise, and no token of that cycle is streamed."""
    model, head = pair
    p = prompts(2)[1]
    want = reference_greedy(model, p, NEW)[0, p.shape[1]:].tolist()
    real_greedy, real_sample = ops.verify_greedy, ops.verify_sample

    def clean(logits):
        return torch.nan_to_num(torch.as_tensor(logits), nan=0.0, posinf=0.0)

    monkeypatch.setattr(cycle_mod.ops, "verify_greedy", lambda t, pa, lg, **kw: real_greedy(t, pa, clean(lg), **kw))
    monkeypatch.setattr(cycle_mod.ops, "verify_sample", lambda t, pa, lg, **kw: real_sample(t, pa, clean(lg), **kw))
    with HeteroSpec(model, head, POLICIES["eagle3"](), cuda_graphs=False) as hs:
        # a first call to learn how many tokens come before cycle 3's
        seen = Streamed()
        kw = dict(temperature=1.0, seed=3) if sample else {}
        hs.generate(p, max_new_tokens=NEW, streamer=seen, **kw)
        poison, out = Poison(model.lm_head, at=4), Streamed()
        try:
            with pytest.raises(NonFiniteLogitsError, match="target model .* in cycle 3"):
                hs.generate(p, max_new_tokens=NEW, streamer=out, **kw)
        finally:
            poison.remove()
    streamed = out.tokens[p.shape[1]:]
    # exactly the prefill's token and cycles 1-2's were streamed, and they are the clean run's
    assert streamed == seen.tokens[p.shape[1]:][:len(streamed)] and 1 < len(streamed) < NEW
    if not sample:
        assert streamed == want[:len(streamed)]


class NaNDraft(OracleDraft):
    """The oracle draft, its logits NaN (or +inf) from its ``at``-th call on."""

    def __init__(self, target, at, value=float("nan")):
        super().__init__(target)
        self.at, self.value, self.calls = at, value, 0

    def _logits(self, ids, mask, input_ids, position_ids, first):
        self.calls += 1
        out = super()._logits(ids, mask, input_ids, position_ids, first)
        if self.calls >= self.at:
            out[..., 3] = self.value
        return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["eagle3", "heterospec"])
def test_draft_nan_is_a_clear_error_naming_the_draft(pair, name, value):
    model, _ = pair
    p = prompts(2)[0]
    want = reference_greedy(model, p, NEW)[0, p.shape[1]:].tolist()
    draft = NaNDraft(model, at=6, value=value)
    with HeteroSpec(model, draft, POLICIES[name](), cuda_graphs=False) as hs:
        with pytest.raises(NonFiniteLogitsError) as e:
            hs.generate(p, max_new_tokens=NEW)
        assert "draft model NaNDraft" in str(e.value) and "cycle" in str(e.value)
        draft.at = 10**9
        seq, _ = hs.generate(p, max_new_tokens=NEW)
        assert seq[0, p.shape[1]:].tolist() == want


def test_float16_overflow_says_so(pair):
    """A real overflow: the target in float16 with its lm_head scaled past 65504, on transformers' float16 forward
    (our CPU decoder computes a float16 model in float32: there the same logits are finite, its float32 copy's)."""
    model = tiny_target("llama").half().to(DEVICE)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)   # the largest logit about 1.5e5: inf in float16
    with HeteroSpec(model, None, Policy.autoregressive(), cuda_graphs=False, cpu_decoder=False) as hs:
        with pytest.raises(NonFiniteLogitsError, match=r"LlamaForCausalLM \(float16\).*float16 overflows at 65504"):
            hs.generate(prompts(1)[0], max_new_tokens=8)
    if DEVICE.type == "cpu" and cpu_decoder.why_off("auto", model) is None:
        with HeteroSpec(model, None, Policy.autoregressive()) as hs:
            out, _ = hs.generate(prompts(1)[0], max_new_tokens=8)
        assert out.tolist() == reference_greedy(copy.deepcopy(model).float(), prompts(1)[0].view(1, -1), 8).tolist()


@pytest.mark.parametrize("graphs", GRAPHS)
def test_batch_names_the_request(pair, graphs):
    model, head = pair
    ps = [q[0] for q in prompts(3)]
    poison = Poison(model.lm_head, at=None, row=1)   # on before the recording (Poison)
    try:
        with HeteroSpec(model, head, POLICIES["heterospec"](), cuda_graphs=graphs) as hs:
            hs.generate(ps, max_new_tokens=NEW)     # records the steps (cuda_graphs), which run the target too
            poison.arm(3)
            with pytest.raises(NonFiniteLogitsError, match="target model .* in cycle 2 for request 1, at position"):
                hs.generate(ps, max_new_tokens=NEW)
            poison.arm(None)
            seqs, _ = hs.generate(ps, max_new_tokens=NEW)
    finally:
        poison.remove()
    for q, s in zip(ps, seqs):
        assert s[q.shape[0]:].tolist() == reference_greedy(model, q.view(1, -1), NEW)[0, q.shape[0]:].tolist()


def test_batch_flags_alone_stop_the_cycle(pair, monkeypatch):
    model, head = pair
    real = ops.verify_greedy
    monkeypatch.setattr(cycle_mod.ops, "verify_greedy",
                        lambda t, pa, lg, **kw: real(t, pa, torch.nan_to_num(lg, nan=0.0, posinf=0.0), **kw))
    ps = [q[0] for q in prompts(3)]
    with HeteroSpec(model, head, POLICIES["eagle3"](), cuda_graphs=False) as hs:
        poison = Poison(model.lm_head, at=3, row=2)
        try:
            with pytest.raises(NonFiniteLogitsError, match="in cycle 2 for request 2"):
                hs.generate(ps, max_new_tokens=NEW)
        finally:
            poison.remove()
