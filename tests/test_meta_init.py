"""Stage 3 meta-device build (Note [Meta-device materialization]): init_fn runs as model.apply(init_fn)
would, with full values; buffers nothing computes raise, naming them; every rank ends with rank 0's values.
Hugging Face models (Llama, GPT-2, BERT, T5) match their unsharded init exactly (skipped without
transformers)."""

from __future__ import annotations

import warnings

import pytest
import torch
import zerocore
from _dist import run_ranks
from torch import nn

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]
DIM = 8


def config() -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def build(factory, seed: int = 0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        return factory()


def reference(factory, init_fn_of, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """The unsharded build: eager model, then init_fn applied by model.apply after the same seed."""
    model = factory()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.apply(init_fn_of(model))
    return model, torch.get_rng_state()


def assert_all_equal(engine, expected: nn.Module) -> None:
    state = engine.full_state_dict(rank0_only=False)
    want = expected.state_dict()
    assert state.keys() == want.keys()
    bad = [k for k in want if not torch.equal(state[k].to(want[k].dtype), want[k])]
    assert not bad, f"differ from the unsharded build: {bad}"
    buffers = dict(engine.module.named_buffers())  # non-persistent ones are not in the state dict
    want_buffers = dict(expected.named_buffers())
    assert buffers.keys() == want_buffers.keys()
    bad = [k for k in want_buffers if not torch.equal(buffers[k], want_buffers[k])]
    assert not bad, f"buffers differ from the unsharded build: {bad}"


# ---- Hugging Face models ------------------------------------------------------------------------------
def hf_factory(name: str):
    import transformers as tf

    small = {"vocab_size": 100}
    if name == "llama":
        return lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**small, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, max_position_embeddings=64))
    if name == "gpt2":
        return lambda: tf.GPT2LMHeadModel(tf.GPT2Config(**small, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                        bos_token_id=0, eos_token_id=0))
    if name == "bert":
        return lambda: tf.BertForMaskedLM(tf.BertConfig(**small, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=64,
                                                        max_position_embeddings=64))
    assert name == "t5"
    return lambda: tf.T5ForConditionalGeneration(tf.T5Config(**small, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                             num_heads=4))


def hf_worker(rank: int, world: int, name: str, explicit: bool) -> bool:
    import transformers

    transformers.logging.set_verbosity_error()
    factory = hf_factory(name)
    torch.manual_seed(0)
    expected, rng_after = reference(factory, lambda m: m._init_weights, seed=1)
    model = build(factory, seed=1)
    # without init_fn a Hugging Face model takes its own _init_weights, not torch's reset_parameters()
    engine = zerocore.initialize(model, config(), **({"init_fn": model._init_weights} if explicit else {}))
    assert len(engine.stage3.units) > 1  # the layers are units: materialized and sharded one by one
    assert torch.equal(torch.get_rng_state(), rng_after), "the RNG must advance exactly as the unsharded init"
    assert_all_equal(engine, expected)
    return True


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5"])
def test_hugging_face_meta_build_with_init_weights_equals_the_unsharded_build(name, explicit):
    pytest.importorskip("transformers", minversion="5")  # v5: _init_weights recomputes buffers
    assert all(run_ranks(hf_worker, 2, name, explicit, timeout=240))


# ---- plain torch models -------------------------------------------------------------------------------
class Attention(nn.Module):  # owns no tensors itself; its init rescales a child's weight (GPT-2's c_proj)
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.attn.proj(h))


class Net(nn.Module):
    def __init__(self, persistent: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 16, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("position_ids", torch.arange(12).view(1, -1), persistent=persistent)
        self.register_buffer("scale", torch.full((DIM,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def net_init(model: Net, generator: torch.Generator | None = None):
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0, generator=generator)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, Attention):
            nn.init.normal_(module.proj.weight, std=0.001, generator=generator)  # after its child, as apply does
        elif isinstance(module, Net):
            module.position_ids.copy_(torch.arange(module.position_ids.shape[-1]).view(1, -1))
            module.scale.fill_(0.5)
            for block in module.blocks:  # the root reaching into the layers' units
                block.norm.bias.add_(0.25)
            nn.init.normal_(module.head.weight, std=0.1, generator=generator)  # the tie: last write wins
    return init


def apply_order_worker(rank: int, world: int) -> bool:
    expected, rng_after = reference(Net, net_init)
    model = build(Net)
    engine = zerocore.initialize(model, config(), init_fn=net_init(model))
    assert [u.name for u in engine.stage3.units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert_all_equal(engine, expected)
    # still trains
    tokens = torch.randint(0, 16, (2, 12))
    loss = engine(tokens).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return True


def test_init_fn_runs_as_model_apply_on_every_module_with_full_values():
    assert all(run_ranks(apply_order_worker, 2))


def missing_buffer_worker(rank: int, world: int, persistent: bool, with_init_fn: bool) -> str:
    model = build(lambda: Net(persistent))

    def init(module: nn.Module) -> None:  # initializes the parameters only
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
        if isinstance(module, Net):
            module.scale.fill_(0.5)

    with pytest.raises(ValueError, match=r"buffer 'position_ids' .*init_fn") as error:
        zerocore.initialize(model, config(), init_fn=init if with_init_fn else None)
    return str(error.value)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("with_init_fn", [False, True])
def test_a_meta_buffer_nothing_computes_raises_naming_it(persistent, with_init_fn):
    messages = run_ranks(missing_buffer_worker, 2, persistent, with_init_fn)
    assert all("'position_ids'" in m for m in messages)


def missing_param_worker(rank: int, world: int) -> str:
    model = build(Net)

    def init(module: nn.Module) -> None:  # forgets the LayerNorms
        net_init(model)(module) if not isinstance(module, nn.LayerNorm) else None

    with pytest.raises(ValueError, match=r"parameter 'blocks.0.norm.weight' .*init_fn"):
        zerocore.initialize(model, config(), init_fn=init)
    return "ok"


def test_a_parameter_init_fn_leaves_unset_raises_naming_it():
    assert all(run_ranks(missing_param_worker, 2))


class WithFrozen(Net):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.zeros(DIM), requires_grad=False)


def rank_init(model: nn.Module, rank: int):
    generator = torch.Generator().manual_seed(1234 + rank)  # the init_fn's own stream, different per rank
    base = net_init(model, generator)

    def init(module: nn.Module) -> None:
        base(module)
        if isinstance(module, WithFrozen):
            nn.init.normal_(module.frozen, generator=generator)
            module.scale.normal_(generator=generator)
    return init


def rank_worker(rank: int, world: int) -> bool:
    expected, _ = reference(WithFrozen, lambda m: rank_init(m, 0))  # rank 0's values
    model = build(WithFrozen)
    engine = zerocore.initialize(model, config(), init_fn=rank_init(model, rank))
    assert_all_equal(engine, expected)
    assert torch.equal(model.frozen, expected.frozen)
    return True


def test_an_init_fn_with_per_rank_values_leaves_every_rank_with_rank_0s():
    assert all(run_ranks(rank_worker, 2))


def fallback_worker(rank: int, world: int) -> bool:
    def init_of(model: nn.Module):
        base = net_init(model)

        def init(module: nn.Module) -> None:
            base(module)
            if isinstance(module, nn.Linear):  # .item() cannot run on meta tensors
                module.weight.div_(module.weight.abs().max().item())
        return init

    expected, _ = reference(Net, init_of)
    model = build(Net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = zerocore.initialize(model, config(), init_fn=init_of(model))
    assert any("could not run on meta tensors" in str(w.message) for w in caught)
    assert_all_equal(engine, expected)
    return True


def test_an_init_fn_that_cannot_run_on_meta_tensors_still_gives_the_same_values():
    assert all(run_ranks(fallback_worker, 2))
