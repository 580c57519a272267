"""A pretrained LLM with its own tokenizer (issue 22, item 1): the prompt in its chat template, the ids
that reach the model, the label mask, the embedding rows of the added tokens, CTC on those ids."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import SMOKE
from pretrained_helpers import IM_END, make_tiny_pretrained

from speechlm.config import LLMConfig, ModelConfig, load_config
from speechlm.packing.prompt import PromptFormat, build_prompt, build_prompt_format, build_prompts
from speechlm.packing.thd import IGNORE_INDEX, plan_thd

INSTRUCTION, SYSTEM = "Transcribe the audio.", "You write down speech."
TEXTS = ["<|en|> moon blue sun", "<|hi|> माँ पानी", "<|en|> river"]


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return make_tiny_pretrained(tmp_path_factory.mktemp("llm"), langs=["en", "hi"])


@pytest.fixture(scope="module")
def tok(llm_dir):
    from speechlm.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(llm_dir, langs=["en", "hi"])


@pytest.fixture(scope="module")
def auto(tok, tmp_path_factory):
    """transformers' own tokenizer of the same directory, with the tokens the run added."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok.save(tmp_path_factory.mktemp("saved")), local_files_only=True)


def chat_messages(transcript: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"<|audio|>\n{INSTRUCTION}"},
        {"role": "assistant", "content": transcript},
    ]


def collate(tok, texts):
    rows = [tok.encode(t) for t in texts]
    tokens_BL = torch.full((len(rows), max(map(len, rows))), tok.pad_id, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens_BL[b, : len(r)] = torch.tensor(r)
    return rows, tokens_BL, torch.tensor([len(r) for r in rows])


def test_packed_batch_round_trips_to_the_chat_template_and_the_transcript(tok, auto):
    fmt = build_prompt_format(tok, instruction=INSTRUCTION, system_prompt=SYSTEM)
    rows, tokens_BL, lens_B = collate(tok, TEXTS)
    audio_lens = [3, 5, 2]
    layout = plan_thd(build_prompts(tokens_BL, lens_B, prompt=fmt), audio_lens, audio_id=tok.audio_id, cp=2)
    cu = layout.cu_seqlens.tolist()
    for s, (text, target) in enumerate(zip(TEXTS, rows)):
        span = slice(cu[s], cu[s + 1])
        ids, audio, pad = layout.input_ids_T[span], layout.audio_mask_T[span], layout.pad_mask_T[span]
        assert int(audio.sum()) == audio_lens[s]
        first_audio = int(torch.nonzero(audio)[0])
        ids = ids.clone()
        ids[first_audio] = tok.audio_id  # the audio run back to its one placeholder
        keep = ~(audio | pad)
        keep[first_audio] = True
        seq_ids = ids[keep].tolist()
        transcript = tok.decode_verbatim(target)  # "<|en|>moon blue sun"
        rendered = auto.apply_chat_template(chat_messages(transcript), tokenize=False)
        # ids -> text gives back the chat-templated prompt and the transcript ...
        assert tok.decode_verbatim(seq_ids) == rendered
        # ... and they are the LLM tokenizer's ids for that text
        assert seq_ids == auto.encode(rendered, add_special_tokens=False)
        # labels: exactly the transcript (tag first) and the end-of-turn token, in order
        labels = layout.labels_T[span]
        assert labels[labels != IGNORE_INDEX].tolist() == [*target, auto.convert_tokens_to_ids(IM_END)]
        assert text.split()[0] == tok.decode(target[:1], keep_lang_tag=True)


def test_label_mask_is_exactly_the_assistant_tokens_and_end_of_turn(tok):
    fmt = build_prompt_format(tok, instruction=INSTRUCTION)
    target = tok.encode(TEXTS[0])
    ids_L, mask_L = fmt.build(target)
    im_end = tok._id_of(IM_END)
    assert fmt.templated and fmt.stop == (im_end,) and fmt.stop_id == im_end
    assert ids_L[mask_L].tolist() == [*target, im_end]
    n_head = len(fmt.prefix) + 1 + len(fmt.middle)
    assert mask_L.tolist() == [False] * n_head + [True] * (len(target) + 1) + [False] * len(fmt.trailing)
    assert tok.decode_verbatim(fmt.trailing) == "\n"  # ChatML's newline after <|im_end|>: context only
    assert tok.decode_verbatim(fmt.middle).endswith("<|im_start|>assistant\n")  # the assistant header


def test_plain_form_without_a_template(tmp_path):
    from speechlm.data.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(make_tiny_pretrained(tmp_path, langs=["en"], chat_template=False), langs=["en"])
    fmt = build_prompt_format(tok, instruction=INSTRUCTION)
    # no BOS token in this tokenizer: [<audio>, *instruction, *target, eos]
    assert fmt == PromptFormat.plain(
        bos_id=None, eos_id=tok.eos_id, audio_id=tok.audio_id, instruction_ids=tok.encode(INSTRUCTION)
    )
    assert not fmt.templated and fmt.prefix == () and fmt.stop == (tok.eos_id,)
    with pytest.raises(ValueError, match="data.system_prompt"):
        build_prompt_format(tok, system_prompt=SYSTEM)


def test_chat_template_none_and_a_template_file_override(tok):
    plain = build_prompt_format(tok, instruction=INSTRUCTION, chat_template="none")
    assert not plain.templated and plain.stop == (tok.eos_id,)
    own = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    fmt = build_prompt_format(tok, chat_template=own)  # no special token after the content: eos appended
    assert fmt.stop == (tok.eos_id,) and tok.decode_verbatim(fmt.prefix) == "[user]"
    with pytest.raises(ValueError, match="renders the assistant content 0 times"):
        build_prompt_format(tok, chat_template="{{ messages[0]['content'] }}")


def test_sentencepiece_prompt_is_todays_plain_form(demo_data):
    from speechlm.data.tokenizer import Tokenizer

    sp = Tokenizer(demo_data["tok"])
    fmt = build_prompt_format(sp, instruction="transcribe")  # chat_template=auto: SentencePiece has none
    target = sp.encode("<|en|> moon blue")
    ids, mask = build_prompt(target, bos_id=sp.bos_id, eos_id=sp.eos_id, audio_id=sp.audio_id,
                             instruction_ids=sp.encode("transcribe"))  # fmt: skip
    got_ids, got_mask = fmt.build(target)
    assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask)
    assert got_ids[0] == sp.bos_id and got_ids[-1] == sp.eos_id
    with pytest.raises(ValueError, match="needs the LLM's"):
        build_prompt_format(sp, chat_template="{{ x }}")


def _tiny_cfg(llm_dir, ctc_weight=0.3) -> ModelConfig:
    """configs/smoke.yaml's tiny encoder and projector around the pretrained LLM directory."""
    cfg = load_config(SMOKE, [f"model.llm.pretrained={llm_dir}", f"model.ctc_weight={ctc_weight}"])
    return cfg.model


def test_the_ids_that_reach_the_llm_are_its_tokenizers(llm_dir, tok, auto):
    from speechlm.model.speech_llm import SpeechLLM

    torch.manual_seed(0)
    fmt = build_prompt_format(tok, instruction=INSTRUCTION, system_prompt=SYSTEM)
    model = SpeechLLM(
        _tiny_cfg(llm_dir),
        vocab_size=tok.vocab_size,
        pad_id=tok.pad_id,
        audio_id=tok.audio_id,
        prompt=fmt,
        ctc_blank_id=tok.ctc_blank_id,
        ctc_skip_leading=tok.tag_tokens,
        added_token_ids=tok.added_ids,
    )
    seen: list[torch.Tensor] = []
    model.llm.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    rows, tokens_BL, lens_B = collate(tok, TEXTS)
    audio = 0.1 * torch.randn(len(rows), 8000)
    batch = dict(
        audio=audio, audio_lens=torch.tensor([8000, 6000, 4000]), tokens=tokens_BL, token_lens=lens_B
    )
    out = model(batch)
    assert torch.isfinite(out.ce_sum) and torch.isfinite(out.ctc_sum)
    assert out.n_labelled == sum(len(r) + 1 for r in rows)
    audio_lens = model.audio_embed_lengths(batch["audio_lens"])
    layout = plan_thd(
        build_prompts(tokens_BL, lens_B, prompt=model.prompt), audio_lens, audio_id=tok.audio_id
    )
    text = ~(layout.audio_mask_T | layout.pad_mask_T)
    assert torch.equal(seen[0].flatten()[text], layout.input_ids_T[text])  # the packed ids, as built above
    for s, r in enumerate(rows):
        rendered = auto.apply_chat_template(chat_messages(tok.decode_verbatim(r)), tokenize=False)
        want = [i for i in auto.encode(rendered, add_special_tokens=False) if i != tok.audio_id]
        span = slice(int(layout.cu_seqlens[s]), int(layout.cu_seqlens[s + 1]))
        assert seen[0].flatten()[span][text[span]].tolist() == want


def test_ctc_blank_is_the_placeholder_and_skips_the_tag(llm_dir, tok):
    from speechlm.model.speech_llm import SpeechLLM

    model = SpeechLLM(
        _tiny_cfg(llm_dir), vocab_size=tok.vocab_size, pad_id=tok.pad_id, audio_id=tok.audio_id,
        prompt=build_prompt_format(tok), ctc_blank_id=tok.ctc_blank_id, ctc_skip_leading=tok.tag_tokens,
    )  # fmt: skip
    rows, tokens_BL, lens_B = collate(tok, TEXTS)
    targets, target_lens = model.ctc_targets(tokens_BL, lens_B)
    assert model.ctc_blank_id == tok.audio_id and tok.audio_id not in targets.tolist()
    assert [targets[b, :n].tolist() for b, n in enumerate(target_lens.tolist())] == [r[1:] for r in rows]
    # pad (= eos here: the tokenizer has none) is a real token for CTC, never the blank
    assert tok.pad_id == tok.eos_id != model.ctc_blank_id


def _read_llm(llm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llm_dir, dtype=torch.float32)


@pytest.mark.parametrize("tied", [False, True])
def test_added_tokens_get_rows_at_the_mean_of_the_pretrained_rows(tmp_path, tied):
    from speechlm.data.hf_tokenizer import HFTokenizer
    from speechlm.model.attention import ensure_registered
    from speechlm.model.llm import build_llm

    llm_dir = make_tiny_pretrained(tmp_path, langs=["en"], tie_word_embeddings=tied)
    tok = HFTokenizer(llm_dir, langs=["en", "hi"])
    before = _read_llm(llm_dir)
    n = before.get_input_embeddings().weight.shape[0]
    llm = build_llm(
        LLMConfig(pretrained=str(llm_dir)),
        vocab_size=tok.vocab_size,
        pad_id=tok.pad_id,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        dropout=0.0,
        attn_implementation=ensure_registered("reference"),
        added_token_ids=tok.added_ids,
    )
    assert tok.added_ids == (n, n + 1, n + 2)
    pairs = [(before.get_input_embeddings(), llm.get_input_embeddings())]
    pairs.append((before.get_output_embeddings(), llm.get_output_embeddings()))
    for old, new in pairs:
        assert new.weight.shape[0] == n + 3
        assert torch.equal(new.weight[:n], old.weight)  # the pretrained rows are untouched
        mean = old.weight.float().mean(0)
        for i in tok.added_ids:
            torch.testing.assert_close(new.weight[i], mean, rtol=0, atol=1e-7)
    tied_now = llm.get_output_embeddings().weight is llm.get_input_embeddings().weight
    assert tied_now == tied


def test_added_ids_inside_a_padded_matrix_are_reset_to_the_mean(llm_dir):
    """Qwen pads its embedding matrix past the tokenizer: added ids land on existing (untrained) rows."""
    from speechlm.model.attention import ensure_registered
    from speechlm.model.llm import build_llm

    before = _read_llm(llm_dir).get_input_embeddings().weight
    n = before.shape[0]
    llm = build_llm(
        LLMConfig(pretrained=str(llm_dir)), vocab_size=n - 2, pad_id=0, bos_id=None, eos_id=2, dropout=0.0,
        attn_implementation=ensure_registered("reference"), added_token_ids=(n - 2, n - 1),
    )  # fmt: skip
    w = llm.get_input_embeddings().weight
    assert w.shape[0] == n and torch.equal(w[: n - 2], before[: n - 2])
    torch.testing.assert_close(w[n - 1], before[: n - 2].mean(0), rtol=0, atol=1e-7)


def test_greedy_decoding_feeds_the_template_head_and_stops_at_end_of_turn(llm_dir, tok):
    from speechlm.model.speech_llm import SpeechLLM

    torch.manual_seed(0)
    fmt = build_prompt_format(tok, instruction=INSTRUCTION)
    model = SpeechLLM(
        _tiny_cfg(llm_dir, ctc_weight=0.0), vocab_size=tok.vocab_size, pad_id=tok.pad_id,
        audio_id=tok.audio_id, prompt=fmt,
    )  # fmt: skip
    audio, lens = 0.1 * torch.randn(1, 8000), torch.tensor([8000])
    out = model.generate_greedy(audio, lens, max_new_tokens=6, use_cache=False)[0]
    # the stop token ends decoding: made the first emitted token, nothing is returned
    first = out[0]
    model.prompt = dataclasses.replace(fmt, stop=(first,))
    assert model.generate_greedy(audio, lens, max_new_tokens=6, use_cache=False)[0] == []
    seen: list[int] = []
    model.llm.register_forward_hook(
        lambda m, args, kw, o: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    model.prompt = fmt
    model.generate_greedy(audio, lens, max_new_tokens=1, use_cache=False)
    assert seen[0] == len(fmt.prefix) + model.audio_embed_lengths(lens)[0] + len(fmt.middle)


def test_lang_tags_none_supervises_words_only_and_ctc_skips_nothing(llm_dir):
    from speechlm.data.hf_tokenizer import HFTokenizer
    from speechlm.model.speech_llm import SpeechLLM

    tok = HFTokenizer(llm_dir, langs=["en", "hi"], lang_tags="none")
    fmt = build_prompt_format(tok)
    rows, tokens_BL, lens_B = collate(tok, TEXTS)
    ids_L, mask_L = fmt.build(rows[0])
    assert tok.decode_verbatim(ids_L[mask_L].tolist()) == "moon blue sun<|im_end|>"  # no tag to learn
    model = SpeechLLM(
        _tiny_cfg(llm_dir), vocab_size=tok.vocab_size, pad_id=tok.pad_id, audio_id=tok.audio_id, prompt=fmt,
        ctc_blank_id=tok.ctc_blank_id, ctc_skip_leading=tok.tag_tokens,
    )  # fmt: skip
    targets, target_lens = model.ctc_targets(tokens_BL, lens_B)
    assert [targets[b, :n].tolist() for b, n in enumerate(target_lens.tolist())] == rows
