"""What starts and checks real SGLang servers on this machine (docs/plugin.md; docs/pd.md):

    servers.py       one server (`python -m sglang.launch_server`, stock or --enable-ess) and its HTTP client; the
                     deterministic workloads the token checks send
    server_demo.py   `ess demo --server`: stock and ESS serving the same requests, the report
    pd_servers.py    PD on one machine: a prefill server, decode servers and SGLang's router, over Mooncake or NIXL
    pd_check.py      the PD token check against servers started elsewhere (the Docker run, scripts/docker_pd.sh)

Used by the real-server tests, `ess demo --server` and scripts; the mini model lives in ess.reference.
"""
