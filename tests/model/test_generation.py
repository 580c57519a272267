"""Greedy decoding: the batched KV-cache decoder gives exactly the prefix-recompute oracle's tokens, and
both keep running in lockstep (results unchanged) while a peer rank still decodes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from speechlm.config import EncoderConfig, LLMConfig, ModelConfig
from speechlm.model.packed_encoder import PackedFrames
from speechlm.model.speech_llm import SpeechLLM

VOCAB, PAD, BOS, EOS, AUDIO, LANG = 48, 0, 2, 3, 4, 5


def build_model(backend: str = "reference", encoder_packed: bool | None = None) -> SpeechLLM:
    torch.manual_seed(0)
    enc = EncoderConfig(
        packed=encoder_packed,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        subsampling_conv_channels=8,
        num_mel_bins=32,
    )
    llm = LLMConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    cfg = ModelConfig(encoder=enc, llm=llm, projector_hidden=32, attention_backend=backend)
    return SpeechLLM(
        cfg, vocab_size=VOCAB, pad_id=PAD, bos_id=BOS, eos_id=EOS, audio_id=AUDIO, instruction_ids=[7, 8]
    )


def make_audio(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    audio = torch.randn(len(lens), max(lens), generator=g)
    for i, n in enumerate(lens):
        audio[i, n:] = 0
    return audio, torch.tensor(lens)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_kv_cache_gives_the_recompute_hypotheses(backend):
    model = build_model(backend)
    audio, lens = make_audio([16000, 4000, 9000, 2500])
    model.prompt = replace(model.prompt, stop=(VOCAB,))  # never emitted: every clip decodes 12 tokens
    oracle = model.generate_greedy(audio, lens, max_new_tokens=12, use_cache=False)
    assert model.generate_greedy(audio, lens, max_new_tokens=12) == oracle
    # make decoding stop at different steps: stop := the emitted token whose first occurrences differ most

    def stops(t: int) -> set[int]:
        return {o.index(t) if t in o else len(o) for o in oracle}

    model.prompt = replace(
        model.prompt, stop=(max(sorted({t for o in oracle for t in o}), key=lambda t: len(stops(t))),)
    )
    oracle = model.generate_greedy(audio, lens, max_new_tokens=12, use_cache=False)
    cached = model.generate_greedy(audio, lens, max_new_tokens=12, use_cache=True)
    assert cached == oracle
    assert len({len(o) for o in oracle}) > 1  # the clips really stopped at different steps
    forced_oracle = model.generate_greedy(audio, lens, max_new_tokens=6, lang_id=LANG, use_cache=False)
    forced = model.generate_greedy(audio, lens, max_new_tokens=6, lang_id=LANG)
    assert forced == forced_oracle and all(o[0] == LANG for o in forced)
    assert model.generate_greedy(audio, lens, max_new_tokens=0) == [[], [], [], []]


@pytest.mark.parametrize("use_cache", [True, False])
def test_lockstep_hook_runs_extra_steps_without_changing_results(use_cache):
    model = build_model()
    model.prompt = replace(model.prompt, stop=(VOCAB,))  # never emitted: both clips decode all 5 tokens
    audio, lens = make_audio([8000, 3000])
    alone = model.generate_greedy(audio, lens, max_new_tokens=5, use_cache=use_cache)
    calls = {"llm": 0, "asked": []}
    hook = model.llm.register_forward_hook(lambda *_: calls.__setitem__("llm", calls["llm"] + 1))

    def keep_going(local_active: bool) -> bool:  # a peer rank decodes 4 steps longer
        calls["asked"].append(local_active)
        return local_active or calls["asked"].count(False) <= 4

    try:
        synced = model.generate_greedy(
            audio, lens, max_new_tokens=5, use_cache=use_cache, keep_going=keep_going
        )
    finally:
        hook.remove()
    assert synced == alone
    assert calls["asked"].count(False) == 5  # asked once more after the 4 extra steps, then stopped
    assert calls["llm"] == calls["asked"].count(True) + 4  # one forward per step the group went on


def test_kv_cache_is_passed_by_the_keyword_the_installed_transformers_takes():
    """transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old keyword warns and goes in 5.40):
    the cached decoder passes the cache by the name the installed forward declares, without a warning,
    and still takes ``past_key_values`` on a forward that only knows that name."""
    import inspect
    import warnings

    from speechlm.model.generation import cache_keyword

    model = build_model()
    audio, lens = make_audio([8000, 3000])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.filterwarnings("error", message=".*past_key_values.*")
        model.generate_greedy(audio, lens, max_new_tokens=4)
    params = inspect.signature(model.llm.forward).parameters
    assert cache_keyword(model.llm) == ("cache" if "cache" in params else "past_key_values")

    class OldForward:
        def forward(self, inputs_embeds=None, past_key_values=None, use_cache=None):
            raise AssertionError("not called")

    assert cache_keyword(OldForward()) == "past_key_values"


@pytest.mark.parametrize("lang_id", [None, LANG])
def test_joint_ctc_decoding_is_per_clip_and_the_same_with_and_without_cache(lang_id):
    model = build_model()
    assert model.ctc_head is not None
    audio, lens = make_audio([16000, 4000, 9000])
    model.prompt = replace(model.prompt, stop=(VOCAB,))  # the random LLM's eos would end every clip at once
    plain = model.generate_greedy(audio, lens, max_new_tokens=10, lang_id=lang_id)
    model.decode_ctc_weight = 0.0
    assert model.generate_greedy(audio, lens, max_new_tokens=10, lang_id=lang_id) == plain
    model.decode_ctc_weight = 0.6
    joint = model.generate_greedy(audio, lens, max_new_tokens=10, lang_id=lang_id)
    assert joint != plain  # the CTC head's scores change the transcripts
    assert model.generate_greedy(audio, lens, max_new_tokens=10, lang_id=lang_id, use_cache=False) == joint
    for b in range(3):  # a clip decodes alike alone and in the batch: each row reads its own clip's CTC
        n = int(lens[b])
        assert model.generate_greedy(
            audio[b : b + 1, :n], lens[b : b + 1], max_new_tokens=10, lang_id=lang_id
        ) == [joint[b]]
    if lang_id is None:  # the first token (the language tag) is the LLM's alone
        assert [o[0] for o in joint] == [o[0] for o in plain]


def test_joint_ctc_decoding_at_weight_one_spells_the_ctc_heads_transcript():
    from speechlm.model.ctc_prefix import JointCTCScorer

    model = build_model()
    audio, lens = make_audio([12000, 6000])
    model.decode_ctc_weight = 1.0
    got = model.generate_greedy(audio, lens, max_new_tokens=8, lang_id=LANG)
    enc = model.encode_audio(audio, lens)
    for b in range(2):  # the scorer on this clip's CTC posteriors alone, the LLM's logits unused
        hidden = enc.enc_hidden.data_UE[int(enc.enc_lens_B[:b].sum()) :][: int(enc.enc_lens_B[b])]
        logp = model.ctc_head(hidden).log_softmax(-1)[None]
        sc = JointCTCScorer(logp, enc.enc_lens_B[b : b + 1], blank=PAD, eos=EOS, weight=1.0)
        want: list[int] = []
        while len(want) < 7:
            t = int(sc.step([0], torch.zeros(1, VOCAB))[0])
            if t == EOS:
                break
            want.append(t)
        assert got[b] == [LANG, *want]


@pytest.mark.parametrize("use_cache", [True, False])
def test_joint_ctc_candidates_covering_the_vocabulary_give_the_whole_vocabularys_hypotheses(use_cache):
    """`model.decode_ctc_candidates` reaches the scorer: K >= the vocabulary runs the candidates' path and
    decodes what scoring every token (K = 0) decodes, for a batch of clips of different lengths."""
    model = build_model()
    audio, lens = make_audio([16000, 4000, 9000])
    model.prompt = replace(model.prompt, stop=(VOCAB,))
    model.decode_ctc_weight = 0.6
    model.decode_ctc_candidates = 0
    full = model.generate_greedy(audio, lens, max_new_tokens=10, use_cache=use_cache)
    model.decode_ctc_candidates = VOCAB
    assert model.generate_greedy(audio, lens, max_new_tokens=10, use_cache=use_cache) == full
    model.decode_ctc_candidates = 1  # the LLM's first choice and eos only: the CTC head can only stop it
    plain = model.generate_greedy(audio, lens, max_new_tokens=10, use_cache=use_cache)
    assert plain != full


def test_joint_ctc_decoding_reads_packed_and_padded_encoder_frames_alike():
    """The scorer reads the CTC log-probabilities in the encoder's own layout: packed frames
    (``[sum U, V]``) or, for an encoder without a packed path, padded ``[B, U, V]``; the same weights
    decode the same transcripts either way."""
    models = [build_model(encoder_packed=packed) for packed in (True, False)]
    audio, lens = make_audio([16000, 4000, 9000])
    got = []
    for model in models:
        model.prompt = replace(model.prompt, stop=(VOCAB,))
        model.decode_ctc_weight = 0.6
        got.append(model.generate_greedy(audio, lens, max_new_tokens=8))
    assert isinstance(models[0].encode_audio(audio, lens).enc_hidden, PackedFrames)
    assert isinstance(models[1].encode_audio(audio, lens).enc_hidden, torch.Tensor)
    assert got[0] == got[1]


def test_decode_ctc_weight_needs_the_ctc_head():
    from speechlm.config import ConfigError

    cfg = ModelConfig(ctc_weight=0.0, decode_ctc_weight=0.5)
    with pytest.raises(ConfigError, match="decode_ctc_weight=0.5 needs the CTC head"):
        cfg.validate()
    with pytest.raises(ConfigError, match="decode_ctc_weight"):
        ModelConfig(decode_ctc_weight=1.5).validate()
    with pytest.raises(ConfigError, match="decode_ctc_candidates"):
        ModelConfig(decode_ctc_candidates=-1).validate()
