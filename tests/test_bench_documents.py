"""--documents SPEC: equal documents, listed mixes, log-normal draws, length files and data files
cut into rows as training packs them; the useful-FLOP count; one-sentence errors."""
import json
import random
import statistics

import pytest
import torch

from lctrain.bench.documents import Documents, parse_documents, training_rows
from lctrain.config import ConfigError, load_recipe


def test_equal_and_listed_documents_fill_the_row():
    docs = parse_documents("8x8k", 65536)
    assert docs.lengths == (8192,) * 8 and docs.total == 65536
    assert docs.cu_seqlens == tuple(range(0, 65537, 8192))
    mix = parse_documents("20k,12k,9k,7k,5k,4k,3x2k,1k", 65536)
    assert mix.lengths == (20480, 12288, 9216, 7168, 5120, 4096, 2048, 2048, 2048, 1024)
    assert parse_documents(" 4k, 2x1k, rest ", 10000).lengths == (4096, 1024, 1024, 3856)
    assert parse_documents("3x100,rest", 300).lengths == (100, 100, 100)  # nothing left
    assert mix.summary() == "10 documents of 1k..20k tokens, median 5k"
    # rows pooled: the counts' range, then every document's lengths; one row when all are equal
    assert Documents.summary_of([mix, docs]) == (
        "2 rows of 8..10 documents of 1k..20k tokens, median 8k")
    assert Documents.summary_of([Documents((5, 5), "a"), Documents((4, 6), "a")]) == (
        "2 rows of 2 documents of 4..6 tokens, median 5")
    assert Documents.summary_of([docs, docs]) == docs.summary()


@pytest.mark.parametrize("spec, total, words", [
    ("8x8k", 131072, "holds 65536 tokens but the sequence holds 131072.*,rest"),
    ("20k,50k", 65536, "holds 71680 tokens.*shorten it"),
    ("8x8q", 65536, "is not a size"),
    ("x8k", 65536, "item 'x8k' of 'x8k' is not a length"),
    ("0x8k", 65536, "item '0x8k'"),
    ("", 64, "item '' of '' is not a length"),
])
def test_bad_lists_say_what_to_write(spec, total, words):
    with pytest.raises(ConfigError, match=words):
        parse_documents(spec, total)


def test_lognormal_draws_are_reproducible_and_match_their_mean_or_median():
    a = parse_documents("lognormal:mean=12k", 1 << 16)
    b = parse_documents("lognormal:mean=12k", 1 << 16)
    assert a == b and a.total == 1 << 16 and min(a.lengths) >= 1
    assert parse_documents("lognormal:mean=12k,seed=1", 1 << 16) != a
    big = parse_documents("lognormal:mean=2k,sigma=0.5,seed=7", 1 << 23)
    assert abs(statistics.fmean(big.lengths[:-1]) / 2048 - 1) < 0.05
    med = parse_documents("lognormal:median=1k,sigma=1.5", 1 << 23)
    assert abs(statistics.median(med.lengths) / 1024 - 1) < 0.1


@pytest.mark.parametrize("spec, words", [
    ("lognormal:mean=12k,median=4k", "exactly one of mean= or median="),
    ("lognormal:sigma=1", "exactly one of mean= or median="),
    ("lognormal:mean=12k,sigma=0", "sigma is 0.0 but must be in"),
    ("lognormal:mean=12k,seed=x", "seed a whole number"),
    ("lognormal:mean=12k,shape=2", "'shape=2' is not one of mean, median, seed, sigma"),
    ("lognormal:mean=-3", "is not a size"),
])
def test_bad_lognormal_specs(spec, words):
    with pytest.raises(ConfigError, match=words):
        parse_documents(spec, 4096)


def test_length_files_are_laid_end_to_end_and_cut_into_rows(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("3000 5000\n2000,7000\n")
    assert parse_documents(f"lengths:{path}", 4096).lengths == (3000, 1096)
    assert parse_documents(f"lengths:{path}@1", 4096).lengths == (3904, 192)
    assert parse_documents(f"lengths:{path}@3", 4096).lengths == (4096,)
    with pytest.raises(ConfigError, match="holds 17000 tokens, fewer than the 20480 that row 4"):
        parse_documents(f"lengths:{path}@4", 4096)
    with pytest.raises(ConfigError, match="no file"):
        parse_documents(f"lengths:{tmp_path}/none.txt", 4096)
    path.write_text("3000 -5\n")
    with pytest.raises(ConfigError, match="positive whole numbers .*found '-5'"):
        parse_documents(f"lengths:{path}", 4096)


def test_data_files_are_tokenized_with_the_recipe(tmp_path):
    texts = ["a" * 300, "héllo " * 100, "b" * 1000]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    recipe = load_recipe(None)  # the byte tokenizer: bos + UTF-8 bytes + eos per document
    sizes = [len(t.encode()) + 2 for t in texts]
    docs = parse_documents(f"data:{path}", 1000, recipe=recipe)
    assert docs.lengths == (sizes[0], 1000 - sizes[0])
    assert parse_documents(f"data:{path}@1", 1000, recipe=recipe).lengths == \
        (sizes[0] + sizes[1] - 1000, 2000 - sizes[0] - sizes[1])
    with pytest.raises(ConfigError, match="tokenizes the file with a recipe's tokenizer"):
        parse_documents(f"data:{path}", 1000)


def test_useful_flops_count_only_pairs_inside_documents():
    from lctrain.model.flops import attention_flops

    h, d = 32, 128
    dense, eight = (parse_documents(spec, 65536).cu_seqlens for spec in ("64k", "8x8k"))
    assert attention_flops(65536, h, d, True, dense) == 2 * 65536 ** 2 * h * d
    assert attention_flops(65536, h, d, True, eight) == 2 * 65536 ** 2 * h * d / 8
    assert attention_flops(65536, h, d, False, eight) == 4 * 65536 ** 2 * h * d / 8


def _visible_pairs(bounds, causal: bool) -> float:
    """Brute force: (query, key) pairs in one document; causal ones keep key < query and half
    the diagonal (the model's "half of the n² pairs", as every published rate counts them)."""
    doc = [i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) for _ in range(b - a)]
    weight = {True: lambda q, k: 1.0 if k < q else 0.5 if k == q else 0.0,
              False: lambda q, k: 1.0}[causal]
    return sum(weight(q, k) for q in range(len(doc)) for k in range(len(doc)) if doc[q] == doc[k])


@pytest.mark.parametrize("spec", ["5", "3x20,rest", "lognormal:mean=9,sigma=1.2,seed=3", "97"])
@pytest.mark.parametrize("causal", [True, False])
def test_useful_flops_are_four_h_d_per_visible_pair_of_the_shared_model(spec, causal):
    from lctrain.model.flops import BACKWARD_FACTOR, attention_flops

    docs = parse_documents(spec, 97)
    h, d = 3, 16
    pairs = _visible_pairs(docs.cu_seqlens, causal)
    assert attention_flops(97, h, d, causal, docs.cu_seqlens) == 4 * h * d * pairs
    assert BACKWARD_FACTOR == 2.5  # the backward's FLOPs over the forward's


def test_a_bare_count_means_equal_documents_and_each_length_gets_its_own_row(tmp_path):
    from lctrain.bench.documents import parse_each

    assert parse_documents("3", 10).lengths == (3, 4, 3)
    assert parse_documents(" 8 ", 65536).summary() == "8 documents of 8k tokens"
    path = tmp_path / "lengths.txt"
    path.write_text("3000 5000 2000 7000")
    each = parse_each(f"lengths:{path}", [4096, 8192])
    assert each[4096] == parse_documents(f"lengths:{path}", 4096)
    assert each[8192].lengths == (3000, 5000, 192)
    assert parse_each(4, [8, 12]) == {8: parse_documents("4", 8), 12: parse_documents("4", 12)}
    with pytest.raises(ConfigError, match="--documents 0 asks for 0 documents.* 1 to 64"):
        parse_documents("0", 64)
    with pytest.raises(ConfigError, match="needs a positive sequence length, got 0"):
        parse_each("8x8k", [65536, 0])


def test_scaled_documents_keep_the_mix_and_fold_what_shrinks_to_nothing():
    mix = parse_documents("20k,12k,9k,7k,5k,4k,3x2k,1k,rest", 65536)
    small = mix.scaled(4096)
    assert small.total == 4096 and small.lengths == tuple(n // 16 for n in mix.lengths)
    assert small.spec == "20k,12k,9k,7k,5k,4k,3x2k,1k,rest scaled to 4096"
    assert mix.scaled(65536) is mix
    tiny = parse_documents("1,1,1,5,56", 64).scaled(8)  # bounds 0,0,0,0,1,8: two left
    assert tiny.lengths == (1, 7) and tiny.total == 8
    for total in (5, 31, 100):
        drawn = parse_documents("lognormal:mean=7", 211).scaled(total)
        assert drawn.total == total and min(drawn.lengths) >= 1


def test_bench_commands_take_documents_and_refuse_bad_specs_in_one_sentence(tmp_path):
    from typer.testing import CliRunner

    from lctrain.bench.result import load
    from lctrain.cli import app

    texts = ["x" * 40, "y" * 10, "z" * 100]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "kernel.json"
    common = ["--heads", "1", "--head-dim", "8", "--dtype", "float32", "--repeats", "1",
              "--warmup", "0"]
    result = CliRunner().invoke(app, ["bench", "kernel", "--seq-len", "64,128", "--backend",
                                      "reference", "--documents", f"data:{data}", "--recipe",
                                      "tiny", "--dense-reference", "cpu_flash", "--json", str(out),
                                      *common])
    assert result.exit_code == 0, result.output
    rows = {(r["backend"], r["seq_len"]): r for r in load(out).rows}
    for seq_len in (64, 128):  # bos + bytes + eos per document, cut into rows
        docs = parse_documents(f"data:{data}", seq_len, recipe=load_recipe("tiny"))
        assert rows[("reference", seq_len)]["mix"] == docs.summary()
        assert f"documents data:{data} at {seq_len}: {docs.summary()}" in result.stdout
        assert rows[("reference", seq_len)]["of_dense"] > 0
    for command, spec, words in [
            ("kernel", "8x8q", "is not a size"),
            ("kernel", f"data:{data}", "add --recipe RECIPE, or give lengths:FILE"),
            ("kernel", "200", "asks for 200 documents but a sequence of 64 tokens"),
            ("attention", "3x30", "holds 90 tokens but the sequence holds 64")]:
        bad = CliRunner().invoke(app, ["bench", command, "--seq-len", "64", "--documents", spec,
                                       *common])
        assert bad.exit_code == 1 and "Traceback" not in bad.output, bad.output
        (line,) = bad.stderr.splitlines()
        assert line.startswith("error: --documents") and words in line, line


def test_training_rows_draw_each_lognormal_row_anew_and_repeat_a_fixed_mix():
    rows = training_rows("lognormal:median=300,sigma=0.7,seed=5", 4096, 4)
    assert all(r.total == 4096 and r.spec == "lognormal:median=300,sigma=0.7,seed=5" for r in rows)
    assert rows[1].lengths == parse_documents("lognormal:median=300,sigma=0.7,seed=6", 4096).lengths
    assert len({r.lengths for r in rows}) == 4  # every row its own draw
    assert training_rows("4x1k", 4096, 3) == [parse_documents("4x1k", 4096)] * 3
    with pytest.raises(ConfigError, match="use --set data.source=FILE"):
        training_rows("lengths:/nowhere", 4096, 2)
    with pytest.raises(ConfigError, match="seed a whole number"):
        training_rows("lognormal:median=300,seed=x", 4096, 2)


def test_bench_step_trains_on_rows_of_the_mix(tmp_path):
    """Two gloo ranks at cp 2 on rows of a log-normal mix: with the mask the row names the mix
    and the attention balance of its rows; without it there are no documents to balance."""
    from lctrain.bench.step import configurations, run

    configs = configurations(None, ["parallel.cp=2", f"train.output_dir={tmp_path / 'out'}"],
                             [512], ["data.document_mask=true", "data.document_mask=false"])
    result = run(configs, steps=2, nproc=2, warmup=0, documents="lognormal:median=60,sigma=1")
    masked, plain = result.rows
    assert masked["status"] == "ok" and plain["status"] == "ok"
    assert masked["documents"] == "lognormal:median=60,sigma=1"
    drawn = training_rows("lognormal:median=60,sigma=1", 512, 2)
    assert masked["mix"] == Documents.summary_of(drawn)
    assert 1.0 <= masked["attention_balance"] < 2.0 and plain["attention_balance"] is None
    assert result.meta["documents"] == "lognormal:median=60,sigma=1"
    assert not (tmp_path / "out").exists()  # the scratch run, its data and the folder it made are gone


@pytest.mark.parametrize("steps, warmup", [(3, 0), (2, 2)])
def test_bench_step_trains_every_drawn_row_once_as_training_reads_them(tmp_path, steps, warmup):
    """The data bench step writes packs, as training packs it, into one drawn row for each
    micro-batch of the warm-up and timed steps; the loader reads each once (a step's two rows
    grouped by attention work), each timed step the rows `documents_steps` names, and the
    row's mix names them."""
    from lctrain.bench.step import _with_documents, documents_steps
    from lctrain.data import iter_batches, load_tokenizer, prepare_data

    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    spec = f"lognormal:median=40,sigma=0.8,seed={rng.randrange(100)}"
    cfg = load_recipe(None, ["train.grad_accum=2", f"train.seed={rng.randrange(100)}"],
                      seq_len=256)
    drawn, timed = documents_steps(cfg, spec, 1, steps, warmup)
    assert drawn == training_rows(spec, 256, 2 * (warmup + steps))  # 2 micro-batches a step
    cfg, fields = _with_documents(cfg, tmp_path, spec, drawn, timed)
    rows = prepare_data(cfg.data, load_tokenizer(cfg))
    batches = iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=cfg.train.seed,
                           grad_accum=2)
    read = [next(batches).cu_seqlens for _ in range(2 * (warmup + steps))]
    by_bounds = {row.cu_seqlens: row for row in drawn}
    assert len(by_bounds) == len(drawn) and sorted(read) == sorted(by_bounds)
    assert [by_bounds[b] for b in read[2 * warmup:]] == [row for step in timed for row in step]
    assert fields == {"documents": spec,
                      "mix": Documents.summary_of([row for step in timed for row in step])}
    work = {b: sum(n * n for n in row.lengths) for b, row in by_bounds.items()}
    for a, b in zip(read[::2], read[1::2]):  # neighbours in the ranking of the drawn rows' work
        low, high = sorted((work[a], work[b]))
        assert not any(low < w < high for w in work.values())


@pytest.mark.parametrize("nproc, cp, accum", [(2, 1, 2), (2, 2, 2), (4, 2, 1)])
def test_attended_is_the_busiest_rank_share_per_micro_batch_median_over_steps(nproc, cp, accum):
    """A step waits for its busiest dp rank in each micro-batch and runs its micro-batches one
    after another: the share is the mean over micro-batches of the largest Σ n² / S² among its
    dp ranks' rows, median over the steps; 1.0 without the mask (every row one sequence)."""
    from lctrain.bench.step import attended

    rng = random.Random(torch.initial_seed())
    dp, seq = nproc // cp, 1000
    cfg = load_recipe(None, [f"parallel.cp={cp}", f"train.grad_accum={accum}"], seq_len=seq)
    steps = [[parse_documents(f"lognormal:median={rng.randrange(20, 400)},seed={rng.randrange(99)}",
                              seq) for _ in range(dp * accum)] for _ in range(5)]
    share = [sum(max(sum(float(n) ** 2 for n in r.lengths) / seq ** 2
                     for r in rows[u * dp:(u + 1) * dp]) for u in range(accum)) / accum
             for rows in steps]
    assert attended(cfg, nproc, steps) == pytest.approx(statistics.median(share), rel=1e-12)
    plain = load_recipe(None, ["data.document_mask=false"], seq_len=seq)
    assert attended(plain, nproc, steps) == 1.0


