"""What some benchmarks drive, and the tests drive too: fake workers, stage processes over a
loopback transfer, a tiny model testbed with its byte checks, network namespaces for a
multi-host cluster on one machine. Shipped with `bench`, so a benchmark never reaches into
`tests/`."""
