"""Run by tests/test_distributed.py under torchrun: an agent loaded straight
into FSDP2 shards (``shard_load.load_into_shards``) against the same agent
loaded whole and then sharded (``distributed.shard_in_place``).

Two small Qwen3 checkpoints whose dims do not divide by 2 ranks (vocabulary
101, MLP width 37: FSDP2's Shard(0) pads the last rank's shard): one with
tied embeddings saved in bf16 and loaded in fp32, one untied in fp32. Rank 0
writes the comparisons as JSON to argv[1]."""
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from scale import distributed
from scale.shard_load import load_into_shards


def main() -> None:
    torch.set_num_threads(1)
    distributed.setup("cpu")
    ids = torch.tensor([[1, 5, 9, 100, 3, 7], [2, 4, 6, 8, 10, 99]])  # [2, 6]
    out: dict = {"world": distributed.world()}
    root = Path(sys.argv[1]).parent / "checkpoints"  # beside the output, in the test's temporary folder
    for name, tied, saved_dtype in (("tied", True, torch.bfloat16), ("untied", False, torch.float32)):
        config = Qwen3Config(vocab_size=101, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied)
        folder = root / name
        if distributed.is_main():
            torch.manual_seed(0)
            Qwen3ForCausalLM(config).to(saved_dtype).save_pretrained(folder)
        distributed.barrier()
        whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            whole_logits = whole(ids).logits  # [2, 6, 101]
        full_shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
        reference = distributed.shard_in_place(whole)  # the whole-then-shard path
        reads: list = []
        loaded = load_into_shards(folder, torch.float32, "cpu", reads=reads)
        pairs = list(zip(reference.lm.named_parameters(), loaded.lm.named_parameters(), strict=True))
        local_equal = all(n == m and p.to_local().shape == q.to_local().shape
                          and torch.equal(p.to_local(), q.to_local()) for (n, p), (m, q) in pairs)
        buffers_equal = all(torch.equal(b, c) for b, c in zip(reference.lm.buffers(), loaded.lm.buffers(), strict=True))
        shapes_read = {n: s for n, s in reads}
        read_is_local = all(shapes_read[n] == tuple(p.to_local().shape) for n, p in loaded.lm.named_parameters())
        with torch.no_grad():
            loaded.unshard()  # the root (embeddings, norm, head); each layer gathers itself
            shard_logits = loaded.lm(ids).logits  # [2, 6, 101] through the shards: a collective
        loaded.reshard()
        plain = distributed.whole_copy_on_main(loaded)  # gathered layer by layer on rank 0
        numel_read = sum(distributed.gather_objects(sum(torch.Size(s).numel() for _, s in reads)))
        if distributed.is_main():
            with torch.no_grad():
                gathered_logits = plain(ids).logits
            out[name] = {
                "local_equal": local_equal, "buffers_equal": buffers_equal, "read_is_local": read_is_local,
                "n_reads": len(reads), "n_params": len(full_shapes),
                "largest_read_rows_vs_full": max(s[0] / full_shapes[n][0] for n, s in reads),
                "numel_read": numel_read, "numel_whole": sum(torch.Size(s).numel() for s in full_shapes.values()),
                "vocab_rows_of_rank0": shapes_read["model.embed_tokens.weight"][0],
                "shard_logits_diff": float((shard_logits - whole_logits).abs().max()),
                "gathered_logits_diff": float((gathered_logits - whole_logits).abs().max()),
                "gathered_tied": plain.lm_head.weight is plain.model.embed_tokens.weight,
                "shards_tied": loaded.lm.lm_head.weight is loaded.lm.model.embed_tokens.weight,
                "has_lm_head_read": "lm_head.weight" in shapes_read,
            }
    if distributed.is_main():
        Path(sys.argv[1]).write_text(json.dumps(out))


if __name__ == "__main__":
    sys.exit(distributed.rank_main(main)())
