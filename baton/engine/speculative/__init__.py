"""MTP speculative decoding (`speculative.num_draft_tokens`): the MTP head drafts, the target
verifies every draft in one forward with the decode path's numerics, and the recurrent state
is rolled back exactly to the accepted prefix (decoder.py, drafter.py, verify.py)."""
