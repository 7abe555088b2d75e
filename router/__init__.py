"""The router: worker registry, routing policies, and the reserve -> prefill -> decode flow."""
