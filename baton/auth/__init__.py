"""Cluster authentication: the shared secret, its gRPC bearer check, API keys, signed messages.

    secret.py        ClusterSecret: load (BATON_CLUSTER_TOKEN / cluster.token_file), derive one
                     key per purpose, sign and verify (HMAC-SHA256)
    grpc_auth.py     server interceptor (bearer per service, UNAUTHENTICATED otherwise) and
                     the client channel that sends the bearer
    api_keys.py      public API keys for Router.Generate (router.api_keys_file / BATON_API_KEY)
    reservations.py  decode workers sign reservations; prefill workers verify before writing

The raw secret never crosses the wire: gRPC carries a bearer derived from it, the side channel
and reservations carry MACs under other derived keys, so a captured bearer cannot forge either.
"""

from baton.auth.secret import ENV_TOKEN, ClusterSecret, load_secret

__all__ = ["ENV_TOKEN", "ClusterSecret", "load_secret"]
