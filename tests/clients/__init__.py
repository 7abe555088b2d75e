"""`make test-clients`: clients nobody on this project wrote (lm-eval, AIPerf) against Baton."""
