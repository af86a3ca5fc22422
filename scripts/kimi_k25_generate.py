"""Kimi-K2.5 as transformers ships it, with its vision tower compiled by kimi_cg: generate() == eager.

    python scripts/kimi_k25_generate.py            # CPU or CUDA, tiny random model, a few seconds

The model is ``Kimi_K25ForConditionalGeneration`` (MoonViT3d vision tower, projector, a DeepSeek-V3
language model) with a tiny random config: nothing is downloaded. The one line that matters::

    model.model.vision_tower.compile(backend="kimi_cg")

Prompts hold images and a 4-frame video chunk of different sizes. For each, greedy ``generate()``
runs on the eager model and on the compiled one (same weights); the tokens must be identical and
every step's logits within the dtype's tolerance. The vision features themselves are compared too,
and a prompt with other pixels must change the logits (so the check depends on the tower at all).
Prints kimi_cg's counters (lifted graphs, fallbacks) at the end; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import transformers

import kimi_cg

IMAGE, VIDEO, START, END = 250, 251, 252, 253


def tiny_kimi_k25(seed: int = 0):
    from transformers import DeepseekV3Config
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    text = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1,
                            topk_group=1, max_position_embeddings=512, initializer_range=0.2)
    vision = Kimi_K25VisionConfig(patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4,
                                  num_attention_heads=4, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                  merge_kernel_size=[2, 2], initializer_range=0.2)
    config = Kimi_K25Config(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_hidden_size=64,
                            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                            vision_end_token_id=END, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return Kimi_K25ForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()


def prompt(images, video=None, seed: int = 0, device="cpu", dtype=torch.float32) -> dict:
    """input_ids with one placeholder token per merged vision token, and the pixel rows and grids."""
    generator = torch.Generator().manual_seed(seed)
    ids = [1, 17]
    pixels, grids = [], []
    for h, w in images:
        ids += [START] + [IMAGE] * (h * w // 4) + [END, 23]
        pixels.append(torch.randn(h * w, 3, 14, 14, generator=generator))
        grids.append([1, h, w])
    inputs = {"pixel_values": torch.cat(pixels).to(device, dtype), "image_grid_thw": torch.tensor(grids, device=device)}
    if video is not None:
        t, h, w = video
        ids += [START] + [VIDEO] * (h * w // 4) + [END]
        inputs["pixel_values_videos"] = torch.randn(t * h * w, 3, 14, 14, generator=generator).to(device, dtype)
        inputs["video_grid_thw"] = torch.tensor([[t, h, w]], device=device)
    inputs["input_ids"] = torch.tensor([ids + [31, 9]], device=device)
    return inputs


def greedy(model, inputs, steps: int):
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    tolerance = 1e-5  # fp32: compiled vs eager, relative to the largest magnitude

    eager = tiny_kimi_k25().to(args.device)
    compiled = copy.deepcopy(eager)
    compiled.model.vision_tower.compile(backend="kimi_cg")  # the one line

    prompts = [
        prompt([(4, 6)], seed=1, device=args.device),
        prompt([(4, 4), (6, 2)], seed=2, device=args.device),
        prompt([(2, 8)], video=(4, 2, 4), seed=3, device=args.device),
        prompt([(6, 4), (2, 2)], video=(4, 4, 4), seed=4, device=args.device),
    ]
    failures = 0
    for index, inputs in enumerate(prompts):
        try:
            want_tokens, want_logits = greedy(eager, inputs, args.steps)
        except Exception as eager_error:  # noqa: BLE001 - e.g. transformers 5.17's video merge
            # Where eager raises, the compiled model must raise eager's own error, not return something.
            reason = f"{type(eager_error).__name__}: {str(eager_error).splitlines()[0][:160]}"
            try:
                greedy(compiled, inputs, args.steps)
            except type(eager_error):
                print(f"prompt {index}: eager fails under transformers {transformers.__version__} ({reason}); "
                      f"the compiled model raises the same")
                continue
            print(f"prompt {index}: eager fails ({reason}) but the compiled model returned  FAIL")
            failures += 1
            continue
        got_tokens, got_logits = greedy(compiled, inputs, args.steps)
        error = relative(got_logits, want_logits)
        same = torch.equal(got_tokens, want_tokens)
        bad = not same or not error <= tolerance  # NaN fails
        failures += bad
        print(f"prompt {index}: grids {inputs['image_grid_thw'].tolist()}"
              f"{' + video ' + str(inputs['video_grid_thw'].tolist()) if 'video_grid_thw' in inputs else ''}: "
              f"tokens {'identical' if same else 'DIFFER'} {got_tokens[0, -args.steps:].tolist()}, "
              f"logits relative error {error:.2e}{'  FAIL' if bad else ''}")
    # The check must depend on the vision features: other pixels, other logits.
    other = dict(prompts[0], pixel_values=torch.randn_like(prompts[0]["pixel_values"]))
    if relative(greedy(eager, other, 1)[1], greedy(eager, prompts[0], 1)[1]) < 1e-3:
        print("the logits do not depend on the pixels: this check would not see a wrong tower  FAIL")
        failures += 1
    print(f"kimi_cg.counters {dict(kimi_cg.counters)}")
    lifted = kimi_cg.counters["host_programs_built"] > 0 and kimi_cg.counters["lift_fallbacks"] == 0
    if not lifted or kimi_cg.counters["call_fallbacks"]:
        print("the vision tower did not run lifted on every call  FAIL")
        failures += 1
    print("OK: generate() with the kimi_cg tower equals eager" if not failures else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
