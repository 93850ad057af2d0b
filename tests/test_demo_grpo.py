"""The real GRPO run of ``make demo`` (examples/grpo): every logged metric equals an independent recomputation
from the ranks' dumped tensors, the reward rises, a seed fixes the run, a diverging run goes on.

The pytest worker's shared local Ray instance (``ray_session``); the demo reuses it (as it would join
``--address``)."""

from math import comb

import numpy as np
import pytest

from examples.grpo.demo import build_parser, log_run
from examples.grpo.grpo import EOS, PAD, PROMPT_LEN, RESPONSE_LEN, GRPOConfig
from rlmetrics.metrics.validation import process_validation_metrics
from rlmetrics.sinks import read_jsonl

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.torch, pytest.mark.ray, pytest.mark.slow]

STEPS, WORKERS, PROMPTS, GROUP, VAL_EVERY, VAL_SAMPLES, LR = 30, 3, 4, 8, 10, 4, 3e-3
CLIP = GRPOConfig(seed=0, prompts=PROMPTS, group_size=GROUP, lr=LR).clip
ARGS = ("--workers", str(WORKERS), "--prompts", str(PROMPTS), "--group-size", str(GROUP), "--lr", str(LR),
        "--val-every", str(VAL_EVERY), "--val-prompts", "8", "--val-samples", str(VAL_SAMPLES),
        "--sinks", "jsonl", "--seed", "7")  # fmt: skip
UNCHECKABLE = {"perf/process_cpu_mem_used_gb"}  # psutil's reading at submission: nothing to recompute


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_session):
    yield


def demo(out, *args):
    """The run of ``python -m examples.grpo --out OUT ARGS``, without its table and plots."""
    log_run(build_parser().parse_args(["--out", str(out), *args]))
    return read_jsonl(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """30 steps of 3 ranks, each dumping its tensors of every step."""
    out = tmp_path_factory.mktemp("grpo")
    return out, demo(out, "--steps", str(STEPS), "--dump", *ARGS)


def dumps(out, kind, step):
    files = sorted(
        (out / "dump").glob(f"{kind}_step{step:04d}_rank*.pt"), key=lambda p: int(p.stem.split("rank")[1])
    )
    return [torch.load(f, weights_only=False) for f in files]


def reference_reward(prompt, tokens):
    """The task's reward, as a straightforward loop: right positions over the longer length."""
    task, digits = prompt
    want = list(digits) if task == "copy" else list(reversed(digits))
    answer = []
    for t in tokens:
        if t == EOS:
            break
        answer.append(t)
    right = sum(1 for i in range(min(len(answer), len(want))) if answer[i] == want[i])
    return right / max(len(answer), len(want)), float(EOS in tokens and answer == want)


def data_want(b, scores, lengths, prompt_lengths, rows):
    """The data metrics of the responses in ``rows`` (a boolean mask over the concatenated batch)."""
    mask = b["response_mask"].astype(bool) & rows[:, None]
    scores, lengths, prompt_lengths = scores[rows], lengths[rows], prompt_lengths[rows]
    want = {}
    for name, values in (("critic/score", scores), ("critic/rewards", b["token_level_rewards"][rows].sum(1)),
                         ("critic/advantages", b["advantages"][mask]), ("critic/returns", b["returns"][mask]),
                         ("response/length", lengths), ("prompt/length", prompt_lengths),
                         ("response/correct_length", lengths[scores > 0.5]),
                         ("response/wrong_length", lengths[scores <= 0.5])):  # fmt: skip
        if len(values):
            want.update(
                {f"{name}/mean": values.mean(), f"{name}/max": values.max(), f"{name}/min": values.min()}
            )
    want["response/clip_ratio/mean"] = (lengths == RESPONSE_LEN).mean()
    want["prompt/clip_ratio/mean"] = (prompt_lengths == PROMPT_LEN).mean()
    want["response/aborted_ratio"] = (lengths == 0).mean()
    return want


def expected_train(ranks):
    """Numpy on the concatenated batches of all ranks, and the update recomputed per token."""
    keys = ("responses", "attention_mask", "response_mask", "token_level_scores", "token_level_rewards",
            "advantages", "returns", "old_log_probs", "ref_log_prob")  # fmt: skip
    b = {k: np.concatenate([r["batch"][k].double().numpy() for r in ranks]) for k in keys}
    prompts = [p for r in ranks for p in r["prompts"]]
    mask = b["response_mask"].astype(bool)
    scores = b["token_level_scores"].sum(1)
    lengths, prompt_lengths = mask.sum(1), b["attention_mask"][:, :PROMPT_LEN].sum(1)
    # the reward and GRPO's advantages, recomputed from the tokens
    assert scores == pytest.approx(
        [reference_reward(p, t)[0] for p, t in zip(prompts, b["responses"])], abs=1e-6
    )
    groups = scores.reshape(-1, GROUP)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, ddof=1, keepdims=True) + 1e-6)
    assert b["advantages"] == pytest.approx(np.where(mask, adv.reshape(-1, 1), 0.0), abs=1e-5)
    want = data_want(b, scores, lengths, prompt_lengths, np.ones(len(scores), bool))
    tasks = np.array([p[0] for p in prompts])
    for task in sorted(set(tasks)):  # group_by="task": the same metrics over the task's responses
        part = data_want(b, scores, lengths, prompt_lengths, tasks == task)
        want.update({f"group/task/{task}/{name}": value for name, value in part.items()})
    # timing and throughput: seconds averaged over ranks; per-token times and throughput over the
    # tokens of all ranks (each rank ran on one GPU)
    for stage in ranks[0]["timing"]:
        want[f"perf/delta_time/{stage}"] = np.mean([r["timing"][stage] for r in ranks])
    tokens = [
        (r["batch"]["prompts"].ne(PAD).sum().item(), r["batch"]["response_mask"].sum().item()) for r in ranks
    ]
    prompt_tokens, response_tokens = (sum(column) for column in zip(*tokens))
    for stage in ("gen", "ref", "adv", "update_actor"):
        seconds = np.mean([r["timing"][stage] for r in ranks])
        want[f"timing_per_token_ms/{stage}"] = (
            seconds * 1e3 / (response_tokens if stage == "gen" else prompt_tokens + response_tokens)
        )
    want["perf/total_num_tokens"] = prompt_tokens + response_tokens
    want["perf/time_per_step"] = np.mean([r["timing"]["step"] for r in ranks])
    want["perf/throughput"] = want["perf/total_num_tokens"] / (want["perf/time_per_step"] * len(ranks))
    # the update: clipped surrogate, clip fraction, old - new log-prob, k3 KL to the reference, entropy
    sums, count = dict.fromkeys(("pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy"), 0.0), 0.0
    for r in ranks:
        u = r["update"]
        for rows, logp, entropy in zip(u["rows"], u["logp"], u["entropy_tokens"]):
            m = r["batch"]["response_mask"][rows].numpy().astype(bool)
            old, ref, a = (
                r["batch"][k][rows].double().numpy()[m]
                for k in ("old_log_probs", "ref_log_prob", "advantages")
            )
            logp = logp.double().numpy()[m]
            ratio = np.exp(logp - old)
            loss, clipped = -a * ratio, -a * np.clip(ratio, 1 - CLIP, 1 + CLIP)
            sums["pg_loss"] += np.maximum(loss, clipped).sum()
            sums["pg_clipfrac"] += (clipped > loss).sum()
            sums["ppo_kl"] += (old - logp).sum()
            sums["kl_loss"] += np.clip(np.exp(ref - logp) - (ref - logp) - 1, -10, 10).sum()
            sums["entropy"] += entropy.double().numpy()[m].sum()
            count += m.sum()
    want.update({f"actor/{k}": v / count for k, v in sums.items()})
    norms = [r["update"]["grad_norm"] for r in ranks]
    assert all(n == norms[0] for n in norms), "ranks stepped with different gradients"
    want["actor/grad_norm"], want["actor/lr"] = np.mean(norms), LR
    return want


def expected_validation(ranks):
    """The metrics of all ranks' samples in one process; mean@k and pass@k also by hand."""
    sources = [s for r in ranks for s in r["data_sources"]]
    inputs = [s for r in ranks for s in r["sample_inputs"]]
    infos = {k: [v for r in ranks for v in r["infos_dict"][k]] for k in ranks[0]["infos_dict"]}
    want = process_validation_metrics(sources, inputs, infos, exact=True)
    for source in set(sources):
        prompts = sorted({i for s, i in zip(sources, inputs) if s == source})
        samples = [[j for j, i in enumerate(inputs) if i == p] for p in prompts]
        rewards = [np.mean([infos["reward"][j] for j in js]) for js in samples]
        assert want[f"val-core/{source}/reward/mean@{VAL_SAMPLES}"] == pytest.approx(np.mean(rewards))
        for k in (1, 2, 4):
            passed = [
                1 - comb(len(js) - int(sum(infos["exact"][j] for j in js)), k) / comb(len(js), k)
                for js in samples
            ]
            assert want[f"val-aux/{source}/exact/pass@{k}"] == pytest.approx(np.mean(passed))
    return want


def test_every_logged_metric_equals_a_recomputation_from_the_ranks_tensors(run):
    out, log = run
    assert log.steps == list(range(STEPS)) and log.truncated is None
    for record in log.records:
        step, got = record["step"], record["metrics"]
        ranks = dumps(out, "train", step)
        assert len(ranks) == WORKERS
        assert len({r["weights"] for r in ranks}) == 1, f"step {step}: replicas out of sync"
        want = expected_train(ranks)
        val = dumps(out, "val", step)
        assert bool(val) == ((step + 1) % VAL_EVERY == 0)
        if val:
            want.update(expected_validation(val))
        want.update({"meta/coverage": 1.0, "meta/late": 0.0})  # every rank, every metric, nothing late
        assert set(got) - UNCHECKABLE == set(want), step
        for name, value in want.items():
            tol = 1e-5 if name.startswith("actor/") else 1e-9  # per-token terms are float32 on the ranks
            assert got[name] == pytest.approx(value, rel=tol, abs=1e-7), (step, name)


def test_the_reward_rises(run):
    _, log = run
    score = log.series("critic/score/mean")[1]
    assert score[-5:].mean() > 1.5 * score[:5].mean(), score.round(3).tolist()  # ~0.05 -> ~0.12


def test_a_seed_fixes_the_run(run, tmp_path):
    """A 3-step run with the same seed logs what the 30-step run logged in its first 3 steps."""
    _, log = run
    short = demo(tmp_path, "--steps", "3", *ARGS)
    for a, b in zip(short.records, log.records[:3]):
        fixed = {k: v for k, v in a["metrics"].items() if not k.startswith(("perf/", "timing"))}
        assert fixed == {k: b["metrics"][k] for k in fixed}
        assert "actor/pg_loss" in fixed and "critic/score/mean" in fixed


def test_a_diverging_run_carries_nan_and_goes_on(tmp_path):
    with pytest.warns(RuntimeWarning, match="non-finite"):
        log = demo(tmp_path, "--steps", "2", "--workers", "2", "--lr", "10", "--val-every", "1",
                   "--val-prompts", "2", "--sinks", "jsonl")  # fmt: skip
    assert log.steps == [0, 1]
    last = log.records[-1]["metrics"]
    assert np.isnan(last["actor/pg_loss"]) and np.isnan(last["actor/grad_norm"])
    assert np.isfinite(last["critic/score/mean"])  # rewards of what the broken policy still samples
