"""Speculative decoding: a proposer drafts k tokens, the target verifies k+1 in one pass, exact acceptance.

state.py: SpecState, where each row stands, on the device. proposers.py: the Proposer protocol, the
draft model's proposer and prompt lookup. decoder.py: verification. policy.py: when to speculate.
"""
from .decoder import SpeculativeDecoder, speculative_decoder
from .policy import SpeculationPolicy
from .proposers import DraftModelProposer, NgramIndex, NgramProposer, Proposer
from .state import NGRAM, SPEC_MAX_BATCH, SpecState

__all__ = ["NGRAM", "SPEC_MAX_BATCH", "DraftModelProposer", "NgramIndex", "NgramProposer", "Proposer", "SpecState",
           "SpeculationPolicy", "SpeculativeDecoder", "speculative_decoder"]
