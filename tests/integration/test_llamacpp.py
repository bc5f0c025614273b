"""The llama.cpp engine through the stack (`--engine llama.cpp`, specdec.replica.llamacpp) on
the tiny test models written as float32 GGUF files (specdec.tools.tinymodels.write_gguf):
greedy output equals the same GGUF run alone through llama.cpp (llama-cpp-python's own
`Llama.generate`), token for token, at k = 0, with speculation, with SSD, with token trees,
over a multi-turn session, for n > 1 and for concurrent sessions batched into one decode;
mixed pairs (a llama.cpp drafter with a torch verifier, and the reverse) give their
verifier's engine's output; sampled sequences follow the target's distribution (with the
chi-square check's own negative control). Skipped where llama-cpp-python is not installed
(`make install` installs it)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil

import grpc
import pytest

from specdec.sdk import Client
from specdec.v1 import common_pb2, verifier_pb2_grpc
from tests.conftest import PROMPTS, start_up_error
from tests.integration.test_controls import hf  # noqa: F401  (fixture)
from tests.integration.test_gateway import small_stack
from tests.integration.test_lookup import GROUNDED
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

N = 24
# f32 cells: a token's logits within 1e-5 of the one-sequence run whatever the cache's
# layout (forks, trees, other sessions), as the torch engines' fp32 batching is.
ENGINE = ("--engine", "llama.cpp", "--llama-kv-dtype", "f32")


@pytest.fixture(scope="module")
def gguf_models(test_models, tmp_path_factory):
    """Copies of the tiny target and noisy draft, each with its float32 GGUF beside it."""
    from specdec.tools.tinymodels import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, source in (("target", test_models.target), ("draft", test_models.draft_noisy)):
        folder = root / name
        shutil.copytree(source, folder)
        write_gguf(folder)
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def alone(gguf_models):
    """alone(prompt_ids, n): the target GGUF's greedy continuation through llama.cpp alone
    (with the engine's attention settings: f32 cells, no flash attention)."""
    llm = llama_cpp.Llama(
        model_path=str(gguf_models["target"] / "model.gguf"),
        n_ctx=512,
        n_threads=1,
        flash_attn=False,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        verbose=False,
    )
    cache: dict[tuple, list[int]] = {}

    def generate(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            out: list[int] = []
            for token in llm.generate(ids, temp=0.0, reset=True):
                out.append(int(token))
                if len(out) == n:
                    break
            cache[key] = out
        return cache[key]

    return generate


@pytest.fixture(scope="module")
def llama_stack(gguf_models):
    """Drafter and verifier on llama.cpp; gateways `plain`, `ssd` and `trees` over them."""
    with small_stack(
        gguf_models["draft"],
        gguf_models["target"],
        *ENGINE,
        verifier_flags=ENGINE,
        gateway_flags=("--suffix-cache-scope", "off"),
        more_gateways={
            "ssd": ("--ssd", "--suffix-cache-scope", "off"),
            "trees": ("--tree-width", "4", "--suffix-cache-scope", "off"),
        },
    ) as procs:
        yield procs


def test_the_gguf_alone_is_the_checkpoint(tokenizer, alone, reference):
    """The float32 GGUF through llama.cpp alone gives transformers' generate() on the same
    weights: the conversion (tinymodels.write_gguf) is the model the other tests run."""
    for text in PROMPTS[:3]:
        ids = tokenizer(text).input_ids
        assert alone(ids, N) == reference(ids, N), text


@pytest.mark.parametrize(("which", "k"), [("gateway", 0), ("gateway", 3), ("ssd", 3)])
def test_greedy_equals_llama_cpp_alone(llama_stack, tokenizer, alone, which, k):
    with Client(llama_stack[which].address, timeout=120) as client:
        for text in PROMPTS[:4]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=k)
            assert list(got.tokens) == alone(ids, N), (which, k, text)
            if k:
                assert got.stats.draft_tokens > 0
                assert got.stats.accepted_tokens > 0


def test_two_turns_n_choices_and_concurrent_sessions(llama_stack, tokenizer, alone):
    """A session's second turn continues the whole history; n = 3 greedy choices (forks of
    one prefill) are all the same continuation; eight sessions at once, batched into shared
    decodes, are each exact."""
    with Client(llama_stack["gateway"].address, timeout=120) as client:
        first = tokenizer(PROMPTS[0]).input_ids
        one = client.generate(token_ids=first, max_new_tokens=8, k=3, session_id="llama-1")
        more = tokenizer(PROMPTS[1]).input_ids
        two = client.generate(token_ids=more, max_new_tokens=N, k=3, session_id="llama-1")
        assert list(two.tokens) == alone([*first, *one.tokens, *more], N)

        ids = tokenizer(PROMPTS[2]).input_ids
        choices = client.generate(token_ids=ids, max_new_tokens=N, k=3, n=3)
        assert [list(c.tokens) for c in choices.choices] == [alone(ids, N)] * 3

        def run(text):
            ids = tokenizer(text).input_ids
            return list(client.generate(token_ids=ids, max_new_tokens=N, k=3).tokens), ids

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for tokens, ids in pool.map(run, PROMPTS * 2):
                assert tokens == alone(ids, N)


@pytest.mark.parametrize("method", ["suffix", "model"])
def test_greedy_trees_equal_llama_cpp_alone(llama_stack, tokenizer, alone, method):
    """Token trees verified in one llama.cpp decode (each leaf a sequence, the accepted path
    kept): llama.cpp's own tokens, and some round's path took another branch than the
    draft's own."""
    results = []
    with Client(llama_stack["trees"].address, timeout=300) as client:
        for text in [*GROUNDED, *PROMPTS[:2]]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=48, k=6, method=method)
            assert list(got.tokens) == alone(ids, 48), (method, text)
            results.append(got)
    assert sum(r.stats.tree_rounds for r in results) > 0
    assert sum(r.stats.tree_other_branch_rounds for r in results) > 0


@pytest.mark.parametrize("which", ["gateway", "ssd"])
def test_sampling_distribution(llama_stack, tokenizer, target_model, which):
    """Sampled at temperature 1, top-k 2, k = 3 (with SSD: its branches drafted on
    llama.cpp sequences): every one of the 16 possible 4-token sequences within 5 sigma of
    its exact probability, and check_sequence_counts' negative control."""
    ids = tokenizer(PROMPTS[0]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    results = sample_top2(llama_stack[which].address, ids, 1200, k=3)
    assert sum(r.stats.accepted_tokens for r in results) > 0
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


@pytest.mark.parametrize("llama_role", ["drafter", "verifier"])
def test_mixed_pairs(gguf_models, test_models, tokenizer, alone, reference, llama_role):
    """A llama.cpp drafter with a torch verifier gives transformers' generate(); a torch
    drafter with a llama.cpp verifier gives llama.cpp's: the verifier's engine decides the
    output, the drafter only the speed (both speak the tokenizer's ids)."""
    drafter = gguf_models["draft"] if llama_role == "drafter" else test_models.draft_noisy
    flags = ENGINE if llama_role == "drafter" else ()
    verifier_flags = ENGINE if llama_role == "verifier" else ()
    expected = alone if llama_role == "verifier" else reference
    with (
        small_stack(drafter, gguf_models["target"], *flags, verifier_flags=verifier_flags) as procs,
        Client(procs["gateway"].address, timeout=120) as client,
    ):
        for text in PROMPTS[:3]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=3)
            assert list(got.tokens) == expected(ids, N), text
            assert got.stats.accepted_tokens > 0


def test_info_and_cost_curve(llama_stack):
    """Info names the engine and the GGUF, and reports the forward cost measured at
    start-up (the policy's prior), as a ragged curve: one line over the tokens a forward
    computes (llama.cpp pads no row)."""
    with grpc.insecure_channel(llama_stack["verifier"].address) as channel:
        info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
            common_pb2.InfoRequest(), timeout=30
        )
    assert info.engine == "llama.cpp"
    assert info.dtype == "gguf"
    assert "model.gguf" in info.dtype_reason
    assert "extra buffer types decoded in a probe" in info.dtype_reason
    assert info.forward_cost.buckets, info.forward_cost
    assert info.forward_cost.ragged
    assert [b.rows for b in info.forward_cost.buckets] == [1]


def test_features_are_not_available(llama_stack, tokenizer):
    """A Verify asking for the target's features (a head drafter's input) is refused with
    one line: llama.cpp's decode gives logits, not the layers' hidden states."""
    from specdec.v1 import verifier_pb2

    ids = tokenizer(PROMPTS[0]).input_ids
    request = verifier_pb2.VerifyRequest(
        session_id="llama/features",
        new_tokens=ids,
        features=common_pb2.FeatureRequest(layers=[2], format=common_pb2.FEATURE_FORMAT_FLOAT32),
    )
    with (
        grpc.insecure_channel(llama_stack["verifier"].address) as channel,
        pytest.raises(grpc.RpcError) as failed,
    ):
        verifier_pb2_grpc.VerifierServiceStub(channel).Verify(request, timeout=30)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert failed.value.details() == (
        "features (the target's hidden states, for a head drafter) are not available with "
        "--engine llama.cpp; run the verifier with --engine dense or paged"
    )


def test_refused_settings(gguf_models):
    """Settings the llama.cpp engine does not run with stop start-up with one line."""
    err = start_up_error("verifier", gguf_models["target"], *ENGINE, "--compile")
    assert "--engine llama.cpp: --compile" in err
    err = start_up_error("drafter", gguf_models["draft"], *ENGINE, "--quantize", "int8")
    assert "--engine llama.cpp runs the GGUF as shipped" in err


def test_extra_buffer_types_fall_back_when_a_decode_crashes(gguf_models, tokenizer, alone):
    """On a Xeon with AMX in a VM, llama.cpp's AMX buffer type crashed the first decode
    (SIGSEGV). The engine probes a decode with the extra buffer types in a child process
    first; when the child dies (here made to die as that crash does), the replica runs
    without them, says why in Info, and is still exact."""
    env = {"SPECDEC_LLAMACPP_PROBE_FAULT": "1"}
    from tests.integration.test_gateway import gateway, replica

    procs = []
    try:
        v = replica("verifier", gguf_models["target"], *ENGINE, env=env)
        d = replica("drafter", gguf_models["draft"], *ENGINE, env=env)
        procs += [v, d]
        v.wait_healthy(), d.wait_healthy()
        g = gateway([d], [v])
        procs.append(g)
        g.wait_healthy()
        with grpc.insecure_channel(v.address) as channel:
            info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
                common_pb2.InfoRequest(), timeout=30
            )
        assert "extra buffer types died of SIGSEGV: they are off" in info.dtype_reason
        with Client(g.address, timeout=120) as client:
            ids = tokenizer(PROMPTS[0]).input_ids
            assert list(client.generate(token_ids=ids, max_new_tokens=N, k=3).tokens) == alone(
                ids, N
            )
    finally:
        for p in procs:
            p.stop()


def test_auto_chooses_the_engine_by_measurement(gguf_models, test_models):
    """--engine auto with a GGUF beside the model times llama.cpp's forwards against the
    torch engine's (the calibration's) and says which it kept and why; without a GGUF it
    keeps the torch engines' choice and says so."""
    from tests.integration.test_gateway import replica

    procs = []
    try:
        with_gguf = replica(
            "verifier", gguf_models["target"], "--engine", "auto", "--dtype", "fastest"
        )
        plain = replica("verifier", test_models.target, "--engine", "auto")
        procs += [with_gguf, plain]
        with_gguf.wait_healthy(), plain.wait_healthy()
        infos = {}
        for name, proc in (("gguf", with_gguf), ("plain", plain)):
            with grpc.insecure_channel(proc.address) as channel:
                infos[name] = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
                    common_pb2.InfoRequest(), timeout=30
                )
        chosen = infos["gguf"]
        assert chosen.engine in ("llama.cpp", "paged")
        assert chosen.dtype_reason.startswith(
            f"engine {chosen.engine}, measured: ms per token at the best draft length "
        )
        assert "on llama.cpp (model.gguf) against" in chosen.dtype_reason
        assert infos["plain"].engine == "paged"
        assert infos["plain"].dtype_reason.startswith("engine paged: no GGUF beside the model")
    finally:
        for p in procs:
            p.stop()


def test_time_shapes_covers_every_cell(gguf_models):
    """The llama.cpp row of `specdec bench --shapes`: a median for every (rows, tokens)
    cell, decoded as the engine batches sessions (rows sequences sharing a prefix)."""
    from specdec.replica.llamacpp import LlamaContext

    context = LlamaContext(gguf_models["target"] / "model.gguf", 512, 128, 1, "f32")
    try:
        cells = context.time_shapes([1, 4, 9], [1, 3], prefix=16, repeats=1)
    finally:
        context.close()
    assert set(cells) == {(r, n) for r in (1, 3) for n in (1, 4, 9)}
    assert all(ms > 0 for ms in cells.values())


def test_the_exactness_check_of_the_bench(llama_stack, gguf_models, tmp_path):
    """`python -m specdec.tools.bench.llamacpp_exact` (the real-weights check of the bench
    page) against the stack: every row identical to llama.cpp alone, exit 0, its JSON."""
    from specdec.tools.bench import llamacpp_exact

    out = tmp_path / "exact.json"
    code = llamacpp_exact.main(
        [
            *("--gateway", llama_stack["gateway"].address),
            *("--target-gguf", str(gguf_models["target"] / "model.gguf")),
            *("--tokenizer", str(gguf_models["target"])),
            *("--num-prompts", "2", "--max-new-tokens", "8", "--kv-dtype", "f32"),
            *("--out", str(out)),
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    assert all(r[m]["identical"] for r in rows for m in ("k=0", "defaults"))


def test_role_price():
    """A drafter is priced by its step; a verifier by ms per emitted token at its best
    draft length: a curve whose extra tokens cost a step each is priced by its step, a flat
    one by a verify of several tokens, so a 4x faster step can lose to a flat curve."""
    from specdec.replica.llamacpp import ACCEPTANCE_PRIOR, role_price

    steep, flat = {1: 57.0, 8: 420.0}, {1: 250.0, 8: 275.0}
    assert role_price(steep, drafter=True) == 57.0
    assert role_price(steep, drafter=False) == 57.0  # k = 0 is its best
    expected = (1 - ACCEPTANCE_PRIOR**8) / (1 - ACCEPTANCE_PRIOR)
    # no better than the best round can do: 8 tokens verified, `expected` emitted at most
    assert 250.0 / expected < role_price(flat, drafter=False) <= 275.0 / expected
    assert role_price({1: 57.0, 8: 60.0}, drafter=False) < 57.0 / 2


@pytest.mark.parametrize("name", ["presence", "repetition", "logit_bias", "all"])
def test_logits_processors_and_logprobs_as_on_torch(llama_stack, tokenizer, hf, name):  # noqa: F811
    """The request's logits processors run on the llama.cpp engine's logits as on the torch
    engine's: greedy with penalties and logit_bias at k = 3 equals transformers' generate()
    with the same processors (the float32 GGUF is the checkpoint, test above), and the
    logprobs the verifier reports are the target's log-softmax within float32 tolerance."""
    import torch

    from tests.integration.test_controls import PROCESSORS

    kwargs, controls = PROCESSORS[name]
    with Client(llama_stack["gateway"].address, timeout=120) as client:
        for text in PROMPTS[:2]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=16, k=3, logprobs=True, **kwargs)
            assert list(got.tokens) == hf(ids, 16, controls), (name, text)
            assert got.logprobs is not None and len(got.logprobs) == len(got.tokens)
    plain = hf(ids, 16, type(controls)())
    with Client(llama_stack["gateway"].address, timeout=120) as client:
        scored = client.generate(token_ids=ids, max_new_tokens=16, k=3, logprobs=True)
    assert list(scored.tokens) == plain
    from transformers import AutoModelForCausalLM  # the checkpoint's own scores

    model = AutoModelForCausalLM.from_pretrained(
        llama_stack_target(llama_stack), dtype=torch.float32
    )
    with torch.inference_mode():
        logits = model(torch.tensor([[*ids, *plain]])).logits[0, len(ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1)
    for i, row in enumerate(scored.logprobs or ()):
        assert row.logprob == pytest.approx(float(expected[i, row.token_id]), abs=1e-3)


def llama_stack_target(stack) -> str:
    """The target folder the stack's verifier serves (its Info's model id)."""
    with grpc.insecure_channel(stack["verifier"].address) as channel:
        info = verifier_pb2_grpc.VerifierServiceStub(channel).Info(
            common_pb2.InfoRequest(), timeout=30
        )
    return info.model_id
