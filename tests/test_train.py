"""Draft trainers on a tiny random Llama: unrolled attention semantics, loss goes down, output formats."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from pipeline.cli import main as specpipe_main
from pipeline.errors import USER_ERROR_EXIT_CODE, UserError
from pipeline.train.data import PROMPT_FILE, PromptSet, build_prompt_set, iter_records, user_prompt
from pipeline.train.distill import DistillSet
from pipeline.train.eagle import EagleDraft
from pipeline.train.eval import chain_stats
from pipeline.train.llama_layer import LayerShape
from pipeline.train.loop import TrainSettings
from pipeline.train.run import FOLDERS, TOKENS_FILE, RunSettings, distill, run_all
from pipeline.train.target import FrozenHead, extract_features

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 96, 48, 8, 4, 2, 96
EOS, PAD = 1, 0
STEPS = 25
PEAK_SCALE = 20.0
WORDS = 300  # the word-level test tokenizer's vocabulary: w0 .. w299
TF_MAX_SEQ = 40


@pytest.fixture(scope="module")
def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=EOS,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peaked next-token distribution, like a trained model's, so there is something to learn
        model.model.embed_tokens.weight.mul_(PEAK_SCALE)
    model.requires_grad_(False)
    return model


def random_prompts() -> PromptSet:
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(2, VOCAB) for _ in range(rng.randrange(4, 12))]
    return PromptSet([prompt() for _ in range(24)], [prompt() for _ in range(4)], EOS, PAD, "random")


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    prompts = random_prompts()
    train = {m: TrainSettings(STEPS, 3e-3, 8, 600.0, 0, eval_every=20) for m in ("medusa", "eagle", "draft", "eagle3")}
    settings = RunSettings(
        ("medusa", "eagle", "draft", "eagle3"),
        max_new_tokens=24,
        gen_batch=8,
        gen_budget_s=600,
        feature_batch=8,
        train=train,
        medusa_heads=3,
        draft_layers=(0, LAYERS - 1),
    )
    out = tmp_path_factory.mktemp("drafts")
    return run_all(tiny_target, prompts, settings, out, pack_dir=out / "packed"), out


def test_unrolled_steps_match_a_sequential_chain():
    """Step s of the unrolled forward equals running the chain one token at a time over true context."""
    torch.manual_seed(1)
    shape = LayerShape(hidden=32, heads=4, kv_heads=2, intermediate=64, rope_theta=10000.0, rms_eps=1e-5)
    draft = EagleDraft(shape).double()
    frozen = FrozenHead(torch.randn(50, 32, dtype=torch.float64), torch.randn(50, 32, dtype=torch.float64))
    tokens = torch.randint(0, 50, (1, 12))
    feats = torch.randn(1, 12, 32, dtype=torch.float64)
    outs = draft.unroll(frozen, tokens, feats, steps=3)
    root = 5
    chain_feats = feats[:, : root + 1]
    for s in range(3):
        n = root + 1 + s
        padded = torch.cat((chain_feats, torch.zeros_like(chain_feats[:, :1])), dim=1)  # position n: unused (causal)
        step = draft.unroll(frozen, tokens[:, : n + 1], padded, steps=1)[0]
        assert torch.allclose(step[0, n - 1], outs[s][0, root + s], atol=1e-10)
        chain_feats = torch.cat((chain_feats, step[:, n - 1 : n]), dim=1)


def test_chain_stats_counts_leading_hits():
    correct = torch.tensor([[True, True, False], [True, False, True], [False, True, True]])
    stats = chain_stats(correct, torch.ones(3, dtype=torch.bool))
    assert stats.mean_accept_length == pytest.approx(1 + (2 + 1 + 0) / 3, abs=1e-4)
    assert stats.conditional_per_depth[:2] == [pytest.approx(2 / 3, abs=1e-4), pytest.approx(0.5, abs=1e-4)]


@pytest.mark.parametrize("method", ["medusa", "eagle", "draft", "eagle3"])
def test_training_lowers_the_held_out_loss(trained, method):
    summary, _ = trained
    result = summary["methods"][method]
    assert result["ok"], result["error"]
    losses = result["log"]["eval_loss"]
    assert losses[-1] < losses[0]


def test_training_continues_from_a_saved_draft(trained, tiny_target, tmp_path):
    """--init-from: the continued run starts at the saved draft's held-out loss (fp16 rounding aside),
    and a draft of another shape is refused before any distillation."""
    summary, out = trained
    base = dict(max_new_tokens=24, gen_batch=8, gen_budget_s=600, feature_batch=8, medusa_heads=3)
    train = {"medusa": TrainSettings(1, 1e-9, 8, 600.0, 0, eval_every=20)}
    continued = run_all(
        tiny_target,
        random_prompts(),
        RunSettings(("medusa",), train=train, **base, init_from={"medusa": out / FOLDERS["medusa"]}),
        tmp_path / "a",
    )
    saved = summary["methods"]["medusa"]["log"]["eval_loss"]
    assert continued["methods"]["medusa"]["log"]["eval_loss"][0] == pytest.approx(saved[-1], rel=1e-3)
    assert saved[-1] != pytest.approx(saved[0], rel=1e-2)  # so a run that ignored the saved heads would fail
    prompts = random_prompts()
    wrong = RunSettings(
        ("medusa",), train=train, **base, medusa_layers=2, init_from={"medusa": out / FOLDERS["medusa"]}
    )
    with pytest.raises(UserError, match="medusa-layers"):
        run_all(tiny_target, prompts, wrong, tmp_path / "c")
    assert not (tmp_path / "c" / TOKENS_FILE).exists()


def test_an_eagle_draft_grows_deeper_from_a_saved_one(trained, tiny_target, tmp_path):
    """--init-from with more --eagle-layers: the added layers start as identity, so the deeper draft starts at
    the saved draft's held-out loss, and its folder is a two-layer SafeAILab draft (layer 1 with its input norm)."""
    summary, out = trained
    base = dict(max_new_tokens=24, gen_batch=8, gen_budget_s=600, feature_batch=8)
    train = {"eagle": TrainSettings(1, 1e-9, 8, 600.0, 0, eval_every=20)}
    settings = RunSettings(("eagle",), train=train, **base, eagle_layers=2, init_from={"eagle": out / FOLDERS["eagle"]})
    grown = run_all(tiny_target, random_prompts(), settings, tmp_path)
    saved = summary["methods"]["eagle"]["log"]["eval_loss"]
    assert grown["methods"]["eagle"]["log"]["eval_loss"][0] == pytest.approx(saved[-1], rel=1e-3)
    weights = load_file(tmp_path / FOLDERS["eagle"] / "model.safetensors")
    assert "layers.1.input_layernorm.weight" in weights and "layers.0.input_layernorm.weight" not in weights
    assert json.loads((tmp_path / FOLDERS["eagle"] / "config.json").read_text())["num_hidden_layers"] == 2


def test_output_folders_follow_the_converter_formats(trained):
    summary, out = trained
    medusa = load_file(out / FOLDERS["medusa"] / "medusa_lm_head.safetensors")
    assert set(medusa) == {f"{h}.0.linear.{p}" for h in range(3) for p in ("weight", "bias")}
    assert medusa["0.0.linear.weight"].shape == (HIDDEN, HIDDEN)
    cfg = json.loads((out / FOLDERS["medusa"] / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["hidden_size"]) == (3, 1, HIDDEN)

    eagle = load_file(out / FOLDERS["eagle"] / "model.safetensors")
    assert eagle["fc.weight"].shape == (HIDDEN, 2 * HIDDEN) and eagle["fc.bias"].shape == (HIDDEN,)
    assert "layers.0.post_attention_layernorm.weight" in eagle and "layers.0.mlp.down_proj.weight" in eagle
    assert not any("input_layernorm" in k or "embed_tokens" in k or k.startswith("norm") for k in eagle)
    assert json.loads((out / FOLDERS["eagle"] / "config.json").read_text())["num_hidden_layers"] == 1

    eagle3 = load_file(out / FOLDERS["eagle3"] / "model.safetensors")
    assert eagle3["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert eagle3["midlayer.self_attn.q_proj.weight"].shape == (HIDDEN, 2 * HIDDEN)
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight"} <= set(eagle3)

    draft = load_file(out / FOLDERS["draft"] / "model.safetensors")
    assert "model.embed_tokens.weight" not in draft and "lm_head.weight" not in draft
    assert {"model.layers.1.mlp.up_proj.weight", "model.norm.weight"} <= set(draft)
    cfg = json.loads((out / FOLDERS["draft"] / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["num_hidden_layers"] == 2
    for folder in FOLDERS.values():
        assert (out / folder / "loss.png").stat().st_size > 0
        assert (out / "packed" / f"{folder}.tar").stat().st_size > 0
    assert (out / "packed" / "summary.json").is_file() and (out / "packed" / "distill_tokens.npz").is_file()


@pytest.fixture(scope="module")
def word_tokenizer():
    """A real (word-level) tokenizer with a chat template, small enough to build in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "user", "assistant"] + [f"w{i}" for i in range(WORDS)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", chat_template=template
    )


def sharegpt_file(path, records: int):
    """Two (human, gpt) pairs a conversation; conversation i + records repeats conversation i's first
    human turn with other replies, as ShareGPT does. Replies run from 12 to 60 words."""
    rng = random.Random(1)
    text = lambda n: " ".join(f"w{rng.randrange(WORDS)}" for _ in range(n))
    firsts = [text(rng.randrange(5, 10)) for _ in range(records)]
    turn = lambda who, value: {"from": who, "value": value}
    convs = [
        {
            "conversations": [
                turn("human", first),
                turn("gpt", text(rng.randrange(12, 60))),
                turn("human", text(8)),
                turn("gpt", text(30)),
            ]
        }
        for first in firsts + firsts
    ]
    path.write_text(json.dumps(convs)[:-5])  # cut off like the packaged file: the last record is dropped
    return path


def test_teacher_forced_rows_avoid_held_out_conversations(word_tokenizer, tmp_path):
    path = sharegpt_file(tmp_path / "sharegpt.json", records=30)
    prompts = build_prompt_set(
        word_tokenizer,
        path,
        count=10,
        held_out=5,
        max_prompt_tokens=20,
        seed=3,
        teacher_forced=40,
        max_seq_tokens=TF_MAX_SEQ,
    )
    plain = build_prompt_set(word_tokenizer, path, count=10, held_out=5, max_prompt_tokens=20, seed=3)
    assert (plain.train, plain.held_out) == (prompts.train, prompts.held_out)  # the split ignores --teacher-forced
    convs = list(iter_records(path))
    assert len(convs) == 59
    held_texts = {
        c["conversations"][0]["value"]
        for c in convs
        if user_prompt(word_tokenizer, c["conversations"][0]["value"]) in prompts.held_out
    }
    held_pairs = {
        turn["value"] for c in convs if c["conversations"][0]["value"] in held_texts for turn in c["conversations"][::2]
    }
    asked = {
        tuple(user_prompt(word_tokenizer, t)): t
        for c in convs
        for t in (c["conversations"][0]["value"], c["conversations"][2]["value"])
    }
    assert len(prompts.teacher_forced) == 40 and len(held_texts) == 5
    eos = word_tokenizer.eos_token_id
    for row, plen in zip(prompts.teacher_forced, prompts.teacher_forced_prompt_lens):
        human = asked[tuple(row[:plen])]  # the prompt part is exactly a templated human turn
        assert human not in held_pairs
        assert len(row) <= TF_MAX_SEQ and len(row) - plen >= 16
        assert eos not in row[plen:-1] and (row[-1] == eos or len(row) == TF_MAX_SEQ)
    assert len({tuple(r) for r in prompts.teacher_forced}) == 40


def test_later_turns_join_train_and_skip_held_out_conversations(word_tokenizer, tmp_path):
    path = sharegpt_file(tmp_path / "sharegpt.json", records=30)
    plain = build_prompt_set(word_tokenizer, path, count=10, held_out=5, max_prompt_tokens=20, seed=3)
    more = build_prompt_set(word_tokenizer, path, count=10, held_out=5, max_prompt_tokens=20, seed=3, later_turns=20)
    assert more.held_out == plain.held_out and more.train[:10] == plain.train  # the split ignores --later-turns
    later = more.train[10:]
    assert len(later) == 20 and len({tuple(p) for p in later}) == 20
    convs = list(iter_records(path))
    held = {
        i
        for i, c in enumerate(convs[:15])  # the first count + held_out usable records are the candidates
        if user_prompt(word_tokenizer, c["conversations"][0]["value"]) in plain.held_out
    }
    second = {tuple(user_prompt(word_tokenizer, c["conversations"][2]["value"])): i for i, c in enumerate(convs)}
    assert len(held) == 5 and all(second[tuple(p)] not in held for p in later)
    with pytest.raises(UserError, match="--later-turns"):
        build_prompt_set(word_tokenizer, path, count=10, held_out=5, max_prompt_tokens=20, seed=3, later_turns=500)


def test_prompt_files_round_trip_and_old_files_load(tmp_path):
    prompts = PromptSet([[5, 6, 7]], [[8, 9]], EOS, PAD, "test", [[5, 6, 7, 8], [9, 10, 11]], [2, 1])
    prompts.save(tmp_path / "new")
    assert PromptSet.load(tmp_path / "new") == prompts
    (tmp_path / "old").mkdir()
    old = {"train": [[5, 6]], "held_out": [[7]], "eos_token_id": EOS, "pad_token_id": PAD, "source": "old"}
    (tmp_path / "old" / PROMPT_FILE).write_text(json.dumps(old))
    loaded = PromptSet.load(tmp_path / "old")
    assert loaded.train == [[5, 6]] and loaded.teacher_forced == [] and loaded.teacher_forced_prompt_lens == []


def test_teacher_forced_rows_join_train_only(tiny_target, tmp_path):
    rng = random.Random(2)
    seq = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]
    forced = [seq(20), seq(13)]
    prompts = PromptSet([seq(5), seq(7)], [seq(6)], EOS, PAD, "random", forced, [8, 4])
    train = {"eagle": TrainSettings(1, 1e-3, 2, 60.0)}
    settings = RunSettings(("eagle",), max_new_tokens=4, gen_batch=4, gen_budget_s=60, feature_batch=4, train=train)
    train_set, held, stats = distill(tiny_target, prompts, settings, tmp_path, None)
    assert len(held.lengths) == 1 and len(train_set.lengths) == 4
    for row, want in zip((2, 3), forced):
        assert train_set.tokens[row, : train_set.lengths[row]].tolist() == want
    assert train_set.prompt_lens[2:].tolist() == [8, 4]
    assert stats["train_teacher_forced_tokens"] == 33 and stats["train_teacher_forced_reply_tokens"] == 21
    assert stats["train_tokens"] == stats["train_self_distilled_tokens"] + 33
    batch = train_set.subset(torch.arange(4))  # features are stored packed, drawn padded
    assert batch.features.shape[:2] == train_set.tokens.shape
    alone, _ = extract_features(tiny_target, torch.tensor([forced[1]]), ())  # batched shortest-first, put back in place
    assert torch.allclose(batch.features[3, :13], alone[0], atol=1e-5) and not batch.features[3, 13:].any()
    assert train_set.features.flat.shape[0] == stats["train_tokens"]  # no padding kept


def test_sampled_copies_join_train_and_survive_the_tokens_file(tiny_target, tmp_path):
    rng = random.Random(3)
    seq = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]
    prompts = PromptSet([seq(5), seq(7), seq(6)], [seq(6)], EOS, PAD, "random")
    train = {"eagle": TrainSettings(1, 1e-3, 2, 60.0)}
    settings = RunSettings(
        ("eagle",),
        max_new_tokens=6,
        gen_batch=4,
        gen_budget_s=60,
        feature_batch=4,
        train=train,
        sample_copies=1,
        sample_temperature=100.0,
    )  # the tiny target is peaked: flatten it
    torch.manual_seed(0)
    train_set, held, _ = distill(tiny_target, prompts, settings, tmp_path, None)
    assert len(held.lengths) == 1 and len(train_set.lengths) == 6
    rows = [train_set.tokens[r, : train_set.lengths[r]].tolist() for r in range(6)]
    starts = sorted(tuple(r[: int(n)]) for r, n in zip(rows, train_set.prompt_lens))
    assert starts == sorted(tuple(p) for p in prompts.train * 2)  # each prompt: one greedy, one sampled row
    assert len({tuple(r) for r in rows}) > 3  # sampling wrote something greedy did not
    again, held_again, _ = distill(tiny_target, prompts, settings, tmp_path / "b", tmp_path / TOKENS_FILE)
    assert torch.equal(again.tokens, train_set.tokens) and torch.equal(held_again.tokens, held.tokens)


def test_a_tokens_file_is_extended_to_new_train_prompts(tiny_target, tmp_path):
    rng = random.Random(4)
    seq = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]
    small = PromptSet([seq(5), seq(7)], [seq(6)], EOS, PAD, "random")
    big = PromptSet(small.train + [seq(4), seq(9)], small.held_out, EOS, PAD, "random")
    train = {"eagle": TrainSettings(1, 1e-3, 2, 60.0)}
    settings = RunSettings(("eagle",), max_new_tokens=6, gen_batch=4, gen_budget_s=60, feature_batch=4, train=train)
    first, held, _ = distill(tiny_target, small, settings, tmp_path / "a", None)
    extended, held_again, _ = distill(tiny_target, big, settings, tmp_path / "b", tmp_path / "a" / TOKENS_FILE)
    fresh, _, _ = distill(tiny_target, big, settings, tmp_path / "c", None)
    rows = lambda d: sorted(tuple(t[: int(n)].tolist()) for t, n in zip(d.tokens, d.lengths))
    assert torch.equal(held_again.tokens, held.tokens)
    assert len(extended.lengths) == 4 and set(rows(first)) < set(rows(extended))
    assert rows(extended) == rows(fresh)  # the two new prompts continued as a fresh run would
    assert len(DistillSet.load_tokens(tmp_path / "b" / TOKENS_FILE, PAD).lengths) == 1 + 4


@pytest.mark.parametrize(
    "flags",
    [
        ["--lr", "eagle=fast"],
        ["--lr", "nope=1e-3"],
        ["--eagle-steps", "0"],
        ["--medusa-layers", "0"],
        ["--budgets", "eagle"],
        ["--sample-copies", "-1"],
        ["--sample-temperature", "0"],
        ["--medusa-hard-weight", "1.5"],
        ["--methods", "medusa", "--init-from", "medusa=/no/such/folder"],
        ["--methods", "medusa", "--init-from", "eagle=drafts/smollm2-eagle"],
    ],
)
def test_run_flags_are_validated(flags, tmp_path, capsys):
    argv = ["train", "run", "--prompts", str(tmp_path), "--output", str(tmp_path / "out"), "--device", "cpu", *flags]
    assert specpipe_main(argv) == USER_ERROR_EXIT_CODE
    assert "error:" in capsys.readouterr().err


def test_medusa_tree_fits_the_trained_heads(trained, tiny_target):
    """Each head's rank of the target's token, capped at max_rank, gives a valid tree no deeper than the heads."""
    from pipeline.engine.tree import tree_from_ranks, validate_choices
    from pipeline.train.tree_fit import head_ranks, load_heads

    _, out = trained
    heads = load_heads(out / FOLDERS["medusa"], "cpu")
    data = DistillSet.load_tokens(out / TOKENS_FILE, PAD)
    max_rank, num_paths = 4, 6
    ranks = head_ranks(tiny_target, heads, data, max_rank)
    assert ranks.shape[1] == len(heads) and ranks.shape[0] > 0 and 0 <= ranks.min() and ranks.max() <= max_rank
    choices, expected = tree_from_ranks(ranks, num_paths, max_rank)
    validate_choices(choices, max_depth=len(heads), max_draft_len=num_paths)
    assert expected >= 1.0


def test_eagle_tree_ranks_are_the_unrolled_chains(trained, tiny_target):
    """Rank 0 at depth d is exactly where the unrolled chain's top-1 hits (what training's held-out chain
    measures), and the tree fitted to the ranks keeps the chain's top-1 spine."""
    from pipeline.engine.tree import tree_from_ranks
    from pipeline.train.eagle import eagle_depth_hits
    from pipeline.train.tree_fit import eagle_ranks, load_eagle

    _, out = trained
    draft = load_eagle(out / FOLDERS["eagle"], tiny_target)
    data = DistillSet.load_tokens(out / TOKENS_FILE, PAD)
    depth, max_rank = 3, 4
    ranks = eagle_ranks(tiny_target, draft, data, depth, max_rank)
    batch = data.subset(torch.arange(len(data.lengths)))
    batch.features = extract_features(tiny_target, batch.tokens, ())[0]
    correct, valid = eagle_depth_hits(draft, FrozenHead.of(tiny_target), batch, depth)
    assert torch.equal(ranks == 0, correct[valid])
    choices, _ = tree_from_ranks(ranks, 6, max_rank)
    assert [0] in choices


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--draft", "medusa:/no/such/heads"], "config.json"),
        (["--draft", "eagle:/no/such/draft"], "config.json"),
        (["--draft", "draft:drafts/smollm2-draft"], "medusa:FOLDER or eagle:FOLDER"),
        (["--num-paths", "0"], "--num-paths, --max-rank and --depth"),
    ],
)
def test_tree_flags_are_validated(flags, message, tmp_path, capsys):
    argv = ["train", "tree", "--output", str(tmp_path / "choices.json"), *flags]
    assert specpipe_main(argv) == USER_ERROR_EXIT_CODE
    assert message in capsys.readouterr().err and not (tmp_path / "choices.json").exists()


@pytest.mark.parametrize("hard_weight", [0.0, 0.3])
def test_medusa_loss_is_each_heads_cross_entropy_to_the_target_later(hard_weight):
    """The shared teacher softmax gives what each head's own definition gives: head h at position p learns
    the target's distribution at p + 1 + h, over positions whose teacher predicts a continuation token."""
    from pipeline.train.medusa import HEAD_DECAY, build_heads, medusa_loss

    torch.manual_seed(2)
    heads = build_heads(HIDDEN, 3, 1)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    frozen = FrozenHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    lengths, prompt_lens = [14, 9], [5, 3]
    tokens = torch.randint(2, VOCAB, (2, 14))
    batch = DistillSet(tokens, torch.tensor(lengths), torch.tensor(prompt_lens))
    batch.features = torch.randn(2, 14, HIDDEN)
    want, norm = 0.0, 0.0
    for h, head in enumerate(heads):
        terms = []
        for row in range(2):
            for pos in range(lengths[row]):
                teacher_pos = pos + 1 + h
                if prompt_lens[row] - 1 <= teacher_pos < lengths[row]:
                    q = torch.log_softmax(frozen.logits(head(batch.features[row, pos])), -1)
                    p = torch.softmax(frozen.logits(batch.features[row, teacher_pos]), -1)
                    terms.append((1 - hard_weight) * -(p * q).sum() - hard_weight * q[p.argmax()])
        want += HEAD_DECAY**h * torch.stack(terms).mean()
        norm += HEAD_DECAY**h
    assert torch.allclose(medusa_loss(heads, frozen, batch, hard_weight), want / norm, atol=1e-5)
