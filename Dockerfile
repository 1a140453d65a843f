# The `ratchet` image: the binary alone on Debian slim, run as an unprivileged user, with its
# SQLite database in the /data volume. By default it serves the API and console on port 7700
# and refuses to start without a token: pass one in RATCHET_API_TOKEN (16 characters or more),
# or mount a configuration of your own at /config/ratchet.toml (README, "Deploy").
#
#     docker build --build-arg RATCHET_GIT_COMMIT="$(git rev-parse --short HEAD)" -t ratchet .
#
# The base images are arguments so that a registry mirror can stand in for Docker Hub.
ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
# The context has no .git (.dockerignore), so the commit `ratchet --version` names comes
# from here.
ARG RATCHET_GIT_COMMIT=
WORKDIR /src
COPY . .
# Without the release profile's line tables the binary is a fifth of its size (45 MB, not
# 200); its symbols stay, so a backtrace still names its functions.
RUN cargo build --release --locked -p ratchet-cli --bin ratchet \
    && strip --strip-debug --output-file /usr/local/bin/ratchet target/release/ratchet

FROM ${RUNTIME_IMAGE}
# Root certificates for model providers, MCP servers, webhooks and PostgreSQL over TLS.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 ratchet \
    && useradd --system --uid 10001 --gid ratchet --home-dir /data --shell /usr/sbin/nologin ratchet \
    && mkdir -p /data \
    && chown ratchet:ratchet /data
COPY --from=build /usr/local/bin/ratchet /usr/local/bin/ratchet
COPY deploy/ratchet.toml /config/ratchet.toml
# The key that seals webhook secrets is made beside the database (/data/ratchet.db.key), so
# the volume keeps both. File tools write in the working directory.
ENV RATCHET_DB=sqlite:///data/ratchet.db
WORKDIR /data
VOLUME ["/data"]
USER ratchet
EXPOSE 7700
# Bash's /dev/tcp instead of an HTTP client the image does not have. A request without `Host`
# passes the server's name check, and /readyz answers 200 once the database does.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/7700 && printf 'GET /readyz HTTP/1.0\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["ratchet"]
CMD ["serve", "--config", "/config/ratchet.toml", "--listen", "0.0.0.0:7700"]
