"""Speculative decoding: a proposer drafts k tokens per sequence and the target model verifies them in one step."""
