# Prometheus from Debian's package, for a machine without an image registry
# (scripts/compose_local.sh puts the binary of the `prometheus` .deb into the build context).
ARG BASE_IMAGE=ec-redis/debian:bookworm
FROM ${BASE_IMAGE}
COPY prometheus /bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && /bin/prometheus --version
WORKDIR /prometheus
ENTRYPOINT ["/bin/prometheus"]
