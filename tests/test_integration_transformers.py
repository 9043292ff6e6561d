"""The transformers adapter on a small random Qwen3-MoE: evenflow's fused MoE as the experts implementation and its
router in place of the softmax top-k routers, against the same model in fp64 (the oracle) under the tolerance rule
(the baseline: the stock model in bf16, transformers' own experts and router)."""

import pytest
import torch

import evenflow
from evenflow.testing import assert_within_rule

transformers = pytest.importorskip("transformers", minversion="5.24")
ev_tf = pytest.importorskip("evenflow.integrations.transformers")


def tiny_config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
    base.update(kw)
    return Qwen3MoeConfig(**base)


def models(device, **kw):
    """(fp64 oracle, stock bf16, bf16 for evenflow) of the tiny Qwen3-MoE (``integrations.demo.twin_models``)."""
    from transformers import Qwen3MoeForCausalLM

    from evenflow.integrations.demo import twin_models

    return twin_models(Qwen3MoeForCausalLM, tiny_config(**kw), device)


def test_logits_within_the_rule_and_the_kernels_run(device, monkeypatch):
    m64, stock, ev = models(device)
    assert ev_tf.enable(ev) == {"experts": 2, "routers": 2}
    assert ev.config._experts_implementation == "evenflow" and stock.config._experts_implementation == "eager"
    calls = {"moe": 0, "router": 0}
    real_moe, real_gemm = evenflow.fused_moe, evenflow.router_gemm
    monkeypatch.setattr(evenflow, "fused_moe", lambda *a, **k: calls.__setitem__("moe", calls["moe"] + 1)
                        or real_moe(*a, **k))
    monkeypatch.setattr(evenflow, "router_gemm", lambda *a, **k: calls.__setitem__("router", calls["router"] + 1)
                        or real_gemm(*a, **k))
    ids = torch.randint(0, 128, (2, 9), device=device)
    with torch.no_grad():
        ref = m64(ids).logits
        base = stock(ids).logits
        got = ev(ids).logits
    assert calls == {"moe": 2, "router": 2}, calls  # both layers' MoE and router went through evenflow
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what="logits")
    assert not torch.equal(got, base)  # not the stock path under another name


def test_experts_and_router_alone(device):
    """One MoE block: the router's top-k ids equal the fp64 router's (random weights: no near-ties), its weights
    within fp32 error; the experts within the rule against fp64 experts (baseline: transformers' bf16 experts)."""
    m64, stock, ev = models(device)
    ev_tf.enable(ev)
    blk64, blk_bf, blk_ev = (m.model.layers[0].mlp for m in (m64, stock, ev))
    assert ev_tf.is_evenflow_router(blk_ev.gate) and not ev_tf.is_evenflow_router(blk_bf.gate)
    x = torch.randn(7, 64, device=device).to(torch.bfloat16)
    with torch.no_grad():
        _, w64, i64 = blk64.gate(x.double())
        _, w_ev, i_ev = blk_ev.gate(x)
        assert torch.equal(i_ev.sort(-1).values, i64.sort(-1).values)
        order64, order_ev = i64.argsort(-1), i_ev.argsort(-1)
        torch.testing.assert_close(w_ev.double().gather(1, order_ev), w64.gather(1, order64), rtol=1e-5, atol=1e-6)
        ref = blk64.experts(x.double(), i64, w64)
        base = blk_bf.experts(x, i64, w64.to(torch.bfloat16))
        got = blk_ev.experts(x, i64, w64.float())
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what="experts")


def test_router_follows_its_weight_and_the_experts_their_parameters(device):
    _, _, ev = models(device)
    ev_tf.enable(ev)
    blk = ev.model.layers[1].mlp
    x = torch.randn(5, 64, device=device).to(torch.bfloat16)
    with torch.no_grad():
        before = blk.gate(x)[0].clone()
        blk.gate.weight.mul_(-1)  # in place: the split must follow
        after = blk.gate(x)[0]
        torch.testing.assert_close(after, -before, rtol=1e-6, atol=1e-6)
        ids = torch.randint(0, 8, (5, 2), device=device)
        w = torch.rand(5, 2, device=device)
        y1 = blk.experts(x, ids, w)
        blk.experts.down_proj.mul_(2)
        y2 = blk.experts(x, ids, w)
    torch.testing.assert_close(y2.float(), 2 * y1.float(), rtol=2 ** -7, atol=1e-3)


def test_refuses_what_it_cannot_run(device):
    m64, _, ev = models(device)
    with pytest.raises(TypeError, match=r"Qwen3MoeExperts: evenflow's fused MoE takes bf16 or fp8 e4m3 experts"):
        ev_tf.enable(m64)
    with pytest.raises(TypeError, match="has no 3-D experts module"):
        ev_tf.enable(torch.nn.Linear(4, 4))
    # round CK's review: enable(None) failed inside with an AttributeError, routers="no" replaced the routers
    with pytest.raises(TypeError, match="model must be a transformers model .*got NoneType"):
        ev_tf.enable(None)
    with pytest.raises(TypeError, match="routers must be a bool, got 'no'"):
        ev_tf.enable(ev, routers="no")
    dense = torch.nn.Module()
    dense.gate_up_proj = torch.nn.Linear(4, 8)  # a dense MLP's projection of that name is not an experts module
    dense.down_proj = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="has no 3-D experts module"):
        ev_tf.enable(dense)
    ev.model.layers[0].mlp.experts.is_transposed = True
    with pytest.raises(TypeError, match="is_transposed=False"):
        ev_tf.enable(ev)
    ev.model.layers[0].mlp.experts.is_transposed = False


def test_experts_without_a_gate_are_refused_by_name_at_the_call(device):
    """Round CP's review: experts of the has_gate=False form (an up_proj, no gate_up_proj; NemotronH's) reaching the
    implementation (register() and experts_implementation='evenflow' at load) raised a bare AttributeError; they are
    refused by the layout check, by name."""
    _, _, ev = models(device)
    experts = ev.model.layers[0].mlp.experts
    experts.has_gate = False
    experts.up_proj = experts.gate_up_proj
    del experts.gate_up_proj
    x = torch.zeros(2, ev.config.hidden_size, dtype=torch.bfloat16, device=device)
    ids, w = torch.zeros(2, 2, dtype=torch.int64, device=device), torch.ones(2, 2, device=device)
    with torch.no_grad(), pytest.raises(TypeError, match="takes has_gate=True experts, this module has has_gate=False"):
        ev_tf.experts_forward(experts, x, ids, w)


def test_an_experts_module_the_interface_does_not_dispatch_is_refused(device):
    """Round CP's review: an experts class not built with transformers' use_experts_implementation (Llama4's) keeps
    its own forward whatever implementation is set, yet enable() counted it as moved to evenflow. A module whose
    config does not end up on 'evenflow' is now refused by name; here one layer's experts hold a config of their own,
    which set_experts_implementation does not reach, as such a module's forward would not read it."""
    import copy

    _, _, ev = models(device)
    experts = ev.model.layers[-1].mlp.experts
    experts.config = copy.deepcopy(experts.config)
    with pytest.raises(TypeError, match=f"{type(experts).__name__}: runs its own forward, which transformers' "
                                        "experts interface does not dispatch"):
        ev_tf.enable(ev)
    experts.config = ev.config
    assert ev_tf.enable(ev)["experts"] == ev.config.num_hidden_layers


def test_register_makes_the_name_known(device):
    from transformers import Qwen3MoeForCausalLM

    ev_tf.register()
    ev_tf.register()  # idempotent
    m = Qwen3MoeForCausalLM(tiny_config()).to(device=device, dtype=torch.bfloat16)
    m.set_experts_implementation("evenflow")
    assert m.config._experts_implementation == "evenflow"
    with torch.no_grad():
        out = m(torch.randint(0, 128, (1, 4), device=device)).logits
    assert torch.isfinite(out.float()).all()


def _fp8_experts(device, **kw):
    """transformers' fine-grained FP8 experts module (what a Qwen3-FP8 checkpoint loads) holding random block-128
    weights, and the same weights as an evenflow holder."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    from evenflow.reference.moe import random_moe_weights

    cfg = tiny_config(hidden_size=256, moe_intermediate_size=128, num_experts=4)
    module = FP8Experts(cfg, block_size=(128, 128), **kw)
    ew = random_moe_weights("fp8_block", 4, 256, 128, device,  # (a holder is made on the device kernels run on)
                            generator=torch.Generator(device=device).manual_seed(3))
    with torch.no_grad():
        for name, t in (("gate_up_proj", ew.w13), ("gate_up_proj_scale_inv", ew.w13_scale), ("down_proj", ew.w2),
                        ("down_proj_scale_inv", ew.w2_scale)):
            getattr(module, name).copy_(t)
    return module.to(device), ew


def test_fp8_block_experts_map_onto_evenflows_holder(device):
    """transformers' FP8Experts (e4m3 weights, 128 x 128 fp32 ``*_scale_inv``, dynamic activations) runs as
    fused_moe on MoEWeights.fp8_block over the same tensors: the same bits as a direct call (which
    tests/test_moe.py holds to the rule against the fp64 oracle), and registered for FP8 experts too."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    ev_tf.register()
    assert "evenflow" in ALL_FP8_EXPERTS_FUNCTIONS
    module, ew = _fp8_experts(device)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 4, (6, 2), generator=g).to(device)
    w = torch.rand(6, 2, generator=g).to(device)
    with torch.no_grad():  # (its fp8 parameters require grad, as transformers builds them)
        got = ev_tf.experts_forward(module, x, ids, w)
        assert torch.equal(got, evenflow.fused_moe(x, ids.to(torch.int32), w, ew))
        for kw, pattern in ((dict(activation_scheme="static"), "activation_scheme='dynamic'"),
                            (dict(swiglu_limit=7.0), "sets limit=7.0")):
            bad, _ = _fp8_experts(device, **kw)
            with pytest.raises(TypeError, match=pattern):
                ev_tf.experts_forward(bad, x, ids, w)
    with pytest.raises(RuntimeError, match="no backward"):
        ev_tf.experts_forward(module, x, ids, w)


def test_router_logits_inference_mode_and_autograd(device):
    """The routers keep their class (output_router_logits records them and the auxiliary loss is computed); a first
    call under inference mode builds the split; a call autograd would record raises."""
    m64, stock, ev = models(device)
    ev_tf.enable(ev)
    ids = torch.randint(0, 128, (2, 5), device=device)
    with torch.no_grad():
        out = ev(ids, output_router_logits=True)
        base = stock(ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (10, 8)
    assert torch.isfinite(out.aux_loss) and abs(float(out.aux_loss) - float(base.aux_loss)) < 1e-2
    ev_tf.refresh(ev)
    with torch.inference_mode():
        got = ev(ids).logits
    with torch.no_grad():
        assert torch.equal(got, ev(ids).logits)
    with pytest.raises(RuntimeError, match="no backward"):
        ev(ids)


def test_other_routers_are_left_alone(device):
    """DeepSeek-V3's router (sigmoid scores, a correction bias, grouped top-k, a scaling factor) is not Qwen3's form:
    enable() leaves it as it is and runs only the experts on evenflow; the logits stay within the rule against the
    same model in fp64."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                           n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                           first_k_dense_replace=0, max_position_embeddings=64)
    from evenflow.integrations.demo import twin_models

    m64, stock, ev = twin_models(DeepseekV3ForCausalLM, cfg, device)
    assert ev_tf.enable(ev) == {"experts": 2, "routers": 0}
    ids = torch.randint(0, 128, (2, 7), device=device)
    with torch.no_grad():
        ref, base, got = (m(ids).logits for m in (m64, stock, ev))
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what="DeepSeek-V3 logits")


def test_fp8_scale_inv_is_transformers_multiplier(device):
    """The fp8 holder's scales mean what transformers' own dequantiser says ``*_scale_inv`` means: the experts'
    output within the rule against fp64 experts on transformers' dequantised weights (the baseline: evenflow's MoE
    reference in its fp32 same-precision form, which quantises activations as the kernel does)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from evenflow.reference.moe import moe_baseline

    module, ew = _fp8_experts(device)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randint(0, 4, (6, 2), generator=g).to(device)
    w = torch.rand(6, 2, generator=g).to(device)
    w13 = _dequantize_fp8_weight(module.gate_up_proj.detach(), module.gate_up_proj_scale_inv.detach(), [128, 128],
                                 torch.float64)
    w2 = _dequantize_fp8_weight(module.down_proj.detach(), module.down_proj_scale_inv.detach(), [128, 128],
                                torch.float64)
    xd = x.double()
    ref = torch.zeros(6, 256, dtype=torch.float64, device=device)
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (w13[e] @ xd[t]).chunk(2)
            ref[t] += float(w[t, k]) * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    with torch.no_grad():
        got = ev_tf.experts_forward(module, x, ids, w)
    base = moe_baseline(x, ids.to(torch.int32), w, ew)
    assert_within_rule(got.cpu(), ref.cpu(), base.cpu(), what="fp8 experts vs transformers' dequantised weights")


def test_demo_runs_at_tiny_shapes(device):
    import types

    from evenflow.integrations.demo import run_demo

    rows = run_demo(types.SimpleNamespace(device=device, gpu=False, harness=None))
    assert len(rows) == 2 and all(r["ok"] for r in rows) and "logits max|err|" in rows[0]["check"], rows
    assert "teacher-forced" in rows[1]["check"], rows


def test_a_model_built_in_inference_mode(device):
    """Parameters made under inference mode keep no version counter: the held expert holder and router split are
    keyed without it (so a call does not fail on it), and the model's logits equal the same weights' in a model
    built normally."""
    from transformers import Qwen3MoeForCausalLM

    _, _, ev = models(device)
    ev_tf.enable(ev)
    with torch.inference_mode():
        inf = Qwen3MoeForCausalLM(tiny_config()).to(device=device, dtype=torch.bfloat16).eval()
        inf.load_state_dict(ev.state_dict())
        ev_tf.enable(inf)
        ids = torch.randint(0, 128, (2, 5), device=device)
        got = inf(ids).logits
        assert torch.equal(got, inf(ids).logits)  # the held state served a second call
        assert torch.equal(got, ev(ids).logits)


def test_experts_holding_the_silu_function_are_taken(device):
    """LFM2-MoE's experts hold ``act_fn = F.silu`` (the function, not a module) and compute SiLU(gate) * up: enable
    takes them (refused as "act_fn is function" before round BX) and the hybrid model's logits (an attention layer
    and a short-convolution layer, each with its experts) stay within the rule of its fp64 twin."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    from evenflow.integrations.demo import twin_models

    cfg = Lfm2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_dense_layers=0, max_position_embeddings=64,
                        layer_types=["full_attention", "conv"])
    m64, stock, ev = twin_models(Lfm2MoeForCausalLM, cfg, device)
    assert ev.model.layers[0].feed_forward.experts.act_fn is torch.nn.functional.silu
    assert ev_tf.enable(ev) == {"experts": 2, "routers": 0}
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        ref, base, got = (m(ids).logits for m in (m64, stock, ev))
    assert_within_rule(got.float().cpu(), ref.cpu(), base.float().cpu(), what="LFM2-MoE logits")


def test_an_older_transformers_is_refused_by_name(monkeypatch):
    # 5.24 is the first release whose attention modules pass their kwargs to cache.update; 5.17 (a device machine's)
    # failed the adapter's tests deep inside generate. The adapter now refuses it on import, naming both versions.
    import transformers as current  # (the module the check imports: an earlier test may have reloaded it)

    monkeypatch.setattr(current, "__version__", "5.17.0")
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.24, found 5\.17\.0"):
        ev_tf._require_transformers()
    monkeypatch.setattr(current, "__version__", "5.24.0.dev0")
    ev_tf._require_transformers()
