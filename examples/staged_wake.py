"""Staged wake: bring back only what is needed, in the order that keeps peak memory lowest.

After an optimizer step the trainer still holds its memory. Waking the weights alone, pushing
the update into them, and only then waking the KV pool means the engine's weights and the
trainer never share the device with the (large) KV pool at the same time.

    python examples/staged_wake.py
"""
import tempfile

import torch
from transformers import AutoModelForCausalLM

from rollout_engine import Engine, EngineAsleepError, SamplingParams, WeightsNotReadyError
from rollout_engine.tiny_model import make_tiny_model
from trainer_adapters import sync_weights

path = make_tiny_model(tempfile.mkdtemp())
engine = Engine(path, kv_cache_memory=64 << 20)
policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device)
greedy = SamplingParams(temperature=0, max_tokens=8)
print("before:", engine.generate("12+34=", greedy)[0].outputs[0].text, engine.memory_stats())

engine.sleep(level=2)                     # KV freed, weights discarded: the trainer has the device
print("asleep:", engine.memory_stats())
with torch.no_grad():                     # stand-in for an optimizer step
    for p in policy.parameters():
        p.mul_(1.01)

engine.wake(tags=["weights"])             # weight memory back, contents not yet valid
try:                                      # refused while the pool sleeps (EngineAsleepError); with the pool
    engine.generate("12+34=", greedy)     # awake it would be WeightsNotReadyError until the update below
except (EngineAsleepError, WeightsNotReadyError) as err:
    print("refused, as it should be:", err)
sync_weights(engine, policy)              # in place: addresses (and CUDA graphs) unchanged
engine.wake(tags=["kv_cache"])            # re-carve the pool from its plan, re-bind every layer
print("after:", engine.generate("12+34=", greedy)[0].outputs[0].text, "version", engine.weight_version)
