# Sourced by benchmark/gpu/server.sh and lease.sh: the carried packages (.whl/site.tar.xz, made here by
# scripts/gpu_carry.sh: stock SGLang, sgl-flash-mla and what SGLang imports that the GPU image lacks) unpacked once
# into SITE (ESS_SITE, default /tmp/ess-site). Returns non-zero, saying why, when the carry is missing.
SITE=${ESS_SITE:-/tmp/ess-site}
if [ ! -f "$SITE/.unpacked" ]; then
  if [ ! -f .whl/site.tar.xz ]; then
    echo "site.sh: .whl/site.tar.xz is missing: run bash scripts/gpu_carry.sh here first, and carry .whl/site.tar.xz" >&2
    return 2
  fi
  mkdir -p "$SITE" && tar -xJf .whl/site.tar.xz -C "$SITE" && touch "$SITE/.unpacked" || return 2
  echo "site.sh: unpacked .whl/site.tar.xz into $SITE"
fi
