"""Hugging Face model families beyond the four the other tests build (Llama, GPT-2, BERT, T5 in test_meta_init
and test_checkpoint): mixture-of-experts layers with 3-D expert weights and a router (Mixtral, Qwen2-MoE),
normed queries and keys (Qwen3, Gemma 3), ALiBi and an embedding LayerNorm (BLOOM), one layer applied again
and again (ALBERT), relative positions (DeBERTa-v2), embeddings shared by encoder, decoder and head (BART), a
parallel attention + MLP block (GPT-J, Falcon, GPT-NeoX), learned positions (OPT); beyond text, a convolutional
feature encoder with a weight_norm-parametrized positional convolution (wav2vec2), an audio encoder-decoder
whose decoder embedding is tied to its head (Whisper), two towers under a contrastive loss with a temperature
at the root (CLIP), and a selective state-space scan reading its parameters directly (Mamba). Each trains at
stage 3 with the optimizer state on the host as the unsharded model does, and under qwZ every module's forward
sees exactly dequantize(quantize(its owner's shard)) (skipped without transformers)."""

from __future__ import annotations

import copy

import pytest
import torch
import zerocore
from _dist import run_ranks
from _forward_values import recorded_forward_values
from test_zeropp import quantized_forward_values

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 64}
# family: (config class, model class, settings past SMALL's, whether float64 runs it)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, True),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, True),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, True),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}, True),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}, True),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_head": 4, "n_layer": 2}, True),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}, True),
    # torch's grouped_mm, which the experts call, takes no float64: these compare with the fp32 model only
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}, False),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64}, False),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", {"embedding_size": 32}, True),
    "deberta": ("DebertaV2Config", "DebertaV2ForMaskedLM", {}, True),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
              "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}, True),
    # beyond text (their batches in BATCHES)
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC",
                 {"conv_dim": (16, 16), "conv_stride": (4, 2), "conv_kernel": (8, 4), "num_conv_pos_embeddings": 8,
                  "num_conv_pos_embedding_groups": 4, "vocab_size": 16, "pad_token_id": 0,
                  "ctc_loss_reduction": "mean", "mask_time_prob": 0.0, "layerdrop": 0.0}, True),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
                 "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 8,
                 "max_source_positions": 16, "max_target_positions": 16, "pad_token_id": 0,
                 "decoder_start_token_id": 1, "eos_token_id": 2, "bos_token_id": 1, "suppress_tokens": None,
                 "begin_suppress_tokens": None}, True),
    "clip": ("CLIPConfig", "CLIPModel",
             {"text_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 16,
                              "bos_token_id": 0, "eos_token_id": 1},
              "vision_config": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "intermediate_size": 64, "image_size": 16, "patch_size": 4},
              "projection_dim": 16}, True),
    "mamba": ("MambaConfig", "MambaForCausalLM", {"state_size": 4, "expand": 2, "conv_kernel": 4}, True),
}


def build(family: str) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config_class, model_class, settings, _ = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SMALL, **settings})
    for key, value in config.to_dict().items():  # every dropout off: the ranks and the references agree
        if ("dropout" in key or "drop" in key.split("_")) and isinstance(value, float):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


def tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, SMALL["vocab_size"], (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# The inputs of the families that read no tokens, or not only tokens (each returns its loss). CLIP's contrastive
# loss couples a rank's batch, so the reference's mean of per-rank losses is what data parallelism trains.
BATCHES = {
    "wav2vec2": lambda g: {"input_values": torch.randn(2, 400, generator=g),
                           "labels": torch.randint(1, 16, (2, 5), generator=g)},
    "whisper": lambda g: {"input_features": torch.randn(2, 8, 32, generator=g),
                          "labels": torch.randint(3, SMALL["vocab_size"], (2, 6), generator=g)},
    "clip": lambda g: {"input_ids": torch.randint(2, 64, (3, 8), generator=g),
                       "pixel_values": torch.randn(3, 3, 16, 16, generator=g), "return_loss": True},
}


def batch(family: str, step: int, rank: int) -> dict[str, torch.Tensor]:
    return BATCHES.get(family, tokens)(torch.Generator().manual_seed(1000 * step + rank))


def in_dtype_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating inputs (audio, pixels) in the dtype of ``model`` (the float64 reference's)."""
    dtype = next(model.parameters()).dtype
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def train_worker(rank: int, world: int, family: str, steps: int) -> list[str]:
    """Stage 3 with the optimizer state on the host against the model trained unsharded on every rank's batch,
    in fp32 and float64. Adam with lr = eps = 1 steps each element by about its gradient g / (|g| + 1): a
    gradient dropped or scaled wrongly moves a tensor by its whole update, while an element whose exact
    gradient is zero (an attention key's bias: softmax ignores a shift) stays at rounding noise instead of
    taking a full Adam step. A tensor passes within 3x the fp32 model's own distance from float64, plus 1e-4
    of how far it moved (or, without float64, 1e-3 of it from the fp32 model)."""
    model = build(family)
    initial = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    references = [copy.deepcopy(model)] + ([copy.deepcopy(model).double()] if FAMILIES[family][3] else [])
    optimizers = [torch.optim.Adam(m.parameters(), lr=1.0, eps=1.0) for m in references]
    engine = zerocore.initialize(model, {
        "optimizer": {"type": "Adam", "params": {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0}},
        "gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": {"device": "cpu"}}})
    for step in range(steps):
        engine.backward(engine(**batch(family, step, rank)).loss)
        engine.step()
        for reference, optimizer in zip(references, optimizers):
            losses = [reference(**in_dtype_of(reference, batch(family, step, r))).loss for r in range(world)]
            (sum(losses) / world).backward()
            optimizer.step()
            optimizer.zero_grad()
    ours = engine.full_state_dict(rank0_only=False)
    fp32, exact = references[0].state_dict(), references[-1].state_dict()
    failures = []
    for name, value in exact.items():
        if not value.is_floating_point():
            assert torch.equal(ours[name], value), name
            continue
        value = value.double()
        moved = float((value - initial[name]).norm())
        distance = float((ours[name].double() - value).norm())
        noise = float((fp32[name].double() - value).norm())
        limit = 3 * noise + 1e-4 * moved if len(references) == 2 else 1e-3 * moved
        if distance > max(limit, 1e-7):
            failures.append(f"{name}: {distance:.3g} from the reference (fp32's noise {noise:.3g}, moved {moved:.3g})")
    return failures


def require(family: str) -> None:
    """Skips without transformers 5 or without the family's model class in the installed version."""
    transformers = pytest.importorskip("transformers", minversion="5")
    if not hasattr(transformers, FAMILIES[family][1]):
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILIES[family][1]}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_hugging_face_family_trains_at_stage_3_as_the_unsharded_model(family):
    require(family)
    for failures in run_ranks(train_worker, 2, family, 3, timeout=240):
        assert not failures, "\n".join(failures)


def forward_values_worker(rank: int, world: int, family: str, group: int) -> list[str]:
    """As test_zeropp's forward_values_worker, over every module that holds parameters: what each forward saw
    equals the unit's flat buffer quantized piece by piece on its owner (a tied or shared tensor under any of
    its names), with hpZ's partitions of 2 and 2 nodes of 2."""
    engine = zerocore.initialize(build(family), {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "zero_node_size": 2, "zero_quantized_weights": True,
                              "zero_hpz_partition_size": 2, "zero_quantization_group_size": group}})
    for step in range(2):  # trained: scales no longer those of the initial values
        engine.backward(engine(**batch(family, step, rank)).loss)
        engine.step()
    with recorded_forward_values(engine.module) as seen:
        with torch.no_grad():
            engine(**batch(family, 2, rank))
    exact = engine.full_state_dict(rank0_only=False)
    expected = quantized_forward_values(engine, exact, world, group)
    assert seen, "no module's forward ran"
    # a tied or shared tensor is in the units once, under one of its names: each name's owner is the unit's
    named = list(engine.module.named_parameters(remove_duplicate=False))
    unit_name = {id(p): n for n, p in named if n in expected}
    owner = {n: unit_name.get(id(p)) for n, p in named}
    failures = []
    for name, value in seen.items():
        if owner[name] is None:
            if not torch.equal(value, exact[name]):  # outside the units (persistent): gathered exact
                failures.append(f"{name}: outside the units, yet not its exact value")
        elif not torch.equal(value.flatten().float(), expected[owner[name]]):
            failures.append(f"{name}: not dequantize(quantize(shard)) of {owner[name]}")
    return failures


@pytest.mark.parametrize("family", ["albert", "bart", "bloom", "gemma3", "mixtral", "qwen2moe"])
def test_qwz_forward_sees_exactly_the_quantized_shards_in_a_hugging_face_family(family):
    require(family)
    for failures in run_ranks(forward_values_worker, 4, family, 256, timeout=240):
        assert not failures, "\n".join(failures)
