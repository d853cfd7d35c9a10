"""The anchor of correctness: radixflow's own model code against transformers' on the same
checkpoint, for a prompt (every position's logits) and for step-by-step decoding."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixflow.kernels import cpu_ext
from radixflow.kernels.dispatch import pick, reference
from radixflow.services.executor.forward_batch import ForwardBatch
from radixflow.services.executor.memory import KVPool, MemoryPlan, StatePool
from radixflow.services.executor.models import ModelSpec, load_model

PAGE = 16


class Harness:
    """One sequence driven through radixflow's model with an explicit page table and state slot."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32, kernels=None):
        self.spec = ModelSpec.from_dir(path)
        self.kernels = kernels or reference()
        self.model = load_model(path, torch.device("cpu"), dtype)
        plan = MemoryPlan(page_size=PAGE, num_pages=64, num_state_slots=4, kv_dtype=dtype,
                          state_dtype=torch.float32)
        self.kv = KVPool(self.spec, plan, torch.device("cpu"))
        self.state = StatePool(self.spec, plan, torch.device("cpu")) if self.spec.is_hybrid else None
        # scattered, non-monotonic pages: a paging bug cannot hide behind contiguous slots
        self.pages = [37, 3, 50, 11, 29, 7, 60, 1]

    def run(self, tokens: list[int], start: int, all_logits: bool) -> torch.Tensor:
        end = len(tokens)
        slots = self.kv.token_slots(self.pages, end)
        n = end - start
        fb = ForwardBatch(is_decode=n == 1 and start > 0, input_ids=torch.tensor(tokens[start:end]),
                          positions=torch.arange(start, end), out_slots=slots[start:end], prefix_lens=[start],
                          extend_lens=[n], seq_slots=[slots], state_slots=torch.tensor([2]),
                          logits_rows=torch.arange(n) if all_logits else torch.tensor([n - 1]),
                          slot_table=slots[None], seq_lens=torch.tensor([end]), kernels=self.kernels)
        return self.model(fb, self.kv, self.state)


def _cache(out):
    # transformers renamed past_key_values to cache in 5.x
    return getattr(out, "cache", None) or out.past_key_values


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid", "tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-moe"])
def test_prompt_and_decode_logits_match_transformers(preset, models):
    path = models[preset]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = Harness(path)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, ours.spec.vocab_size, (77,), generator=g).tolist()   # 77: not a page multiple

    with torch.inference_mode():
        out = hf(torch.tensor([prompt]), use_cache=True)
    ref = out.logits[0]
    got = ours.run(prompt, 0, all_logits=True)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert ref.std() > 1.0   # the comparison is not between two near-constant tensors

    cache, tokens = _cache(out), list(prompt)
    nxt = int(ref[-1].argmax())
    for _ in range(12):          # crosses a page boundary (77 -> 89)
        tokens.append(nxt)
        with torch.inference_mode():
            out = hf(torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = _cache(out)
        ref = out.logits[0, -1]
        got = ours.run(tokens, len(tokens) - 1, all_logits=False)[0]
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
        assert int(got.argmax()) == int(ref.argmax())
        nxt = int(ref.argmax())


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_chunked_prefill_equals_one_pass(preset, models):
    """Prefill in pieces (what prefix reuse and chunked prefill do) == one pass."""
    ours = Harness(models[preset])
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, ours.spec.vocab_size, (100,), generator=g).tolist()
    if ours.state is not None:
        ours.state.reset(2)
    whole = ours.run(prompt, 0, all_logits=True)
    if ours.state is not None:
        ours.state.reset(2)
    parts = [ours.run(prompt[:e], s, all_logits=True) for s, e in [(0, 33), (33, 48), (48, 100)]]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-hybrid"])
def test_bf16_matches_transformers_in_bf16(preset, kernels, models):
    """The bf16 compute dtype (`--dtype bfloat16`) against its own reference, transformers in bf16,
    and both against transformers in fp32 (the exact answer). Both bf16 implementations round at
    different points (ours attends with SDPA's flash kernel on bf16 inputs, accumulating in fp32,
    as GPU engines do; transformers' eager attention rounds its matmuls to bf16), so logits agree
    to bf16 precision, not bit for bit: ours must be about as close to fp32 as transformers' own
    bf16 is, and the greedy token must agree with fp32's wherever fp32's top two logits are
    further apart than transformers' bf16 error reaches on that row (at closer gaps, two correct
    bf16 implementations may pick either). A bf16-weights model that silently ran in fp32 (the
    loader once copied bf16 tensors into fp32 modules) fails the dtype check. With the torch
    references and with the CPU kernels a CPU runner picks (bf16 prefill attention, rotary, ...)."""
    if kernels == "cpu" and cpu_ext.wait(600) is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are needed)")
    path = models[preset]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = Harness(path, torch.bfloat16, pick(torch.device("cpu"), kernels))
    assert all(p.dtype == torch.bfloat16 for n, p in ours.model.named_parameters()
               if not n.endswith(("A_log", "dt_bias", "conv_weight")))
    assert ours.kv.k[0].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, ours.spec.vocab_size, (77,), generator=g).tolist()

    def check(got: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor) -> None:
        got, ref, ref32 = got.float(), ref.float(), ref32.float()
        std = ref32.std()
        assert std > 1.0
        diff = (got - ref).abs()
        assert diff.mean() < 0.03 * std and diff.max() < 0.15 * std, (diff.mean(), diff.max(), std)
        ours_err, hf_err = (got - ref32).abs(), (ref - ref32).abs()
        assert ours_err.mean() < 1.5 * hf_err.mean() and ours_err.max() < 1.5 * hf_err.max(), (
            ours_err.mean(), hf_err.mean(), ours_err.max(), hf_err.max())
        top2 = ref32.topk(2, dim=-1).values
        clear = top2[..., 0] - top2[..., 1] > 2 * hf_err.max(dim=-1).values
        assert clear.float().mean() > 0.5        # most positions have a clear winner to compare
        assert torch.equal(got.argmax(-1)[clear], ref32.argmax(-1)[clear])

    with torch.inference_mode():
        out, out32 = hf(torch.tensor([prompt]), use_cache=True), exact(torch.tensor([prompt]), use_cache=True)
        check(ours.run(prompt, 0, all_logits=True), out.logits[0], out32.logits[0])
        cache, cache32, tokens = _cache(out), _cache(out32), list(prompt)
        refs, refs32, gots = [], [], []
        for _ in range(12):      # teacher-forced on the exact model's tokens, across a page boundary
            tokens.append(int(out32.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            out32 = exact(torch.tensor([[tokens[-1]]]), cache=cache32, use_cache=True)
            cache, cache32 = _cache(out), _cache(out32)
            refs.append(out.logits[0, -1])
            refs32.append(out32.logits[0, -1])
            gots.append(ours.run(tokens, len(tokens) - 1, all_logits=False)[0])
        check(torch.stack(gots), torch.stack(refs), torch.stack(refs32))
