"""Training tooling (not needed to serve): `retention` trains the TRIM-KV retention gates that
policy `trimkv` reads through vase_sglang.gates."""
