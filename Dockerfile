# hetgate gateway image: `docker build -t hetgate .` then
#   docker run -p 8000:8000 -v $PWD/my-config.yaml:/etc/hetgate/config.yaml hetgate
FROM python:3.11-slim

# Routing's compiled kernels (scoring/jit.py) are compiled while the image is built and cached here, where
# the gateway's user may read and write them (site-packages is not writable at run time).
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/var/cache/hetgate/numba
WORKDIR /opt/hetgate
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY scoring ./scoring
COPY kvindex ./kvindex
COPY bench ./bench
COPY configs ./configs
# A regular install: the wheel carries configs/ (as the package hetgate_configs) and the traces.
RUN pip install --no-cache-dir . \
    && useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin hetgate \
    && cd / && python -c "import kvindex, scoring.cost_policy as c; c.compile_kernels(); kvindex.compile_kernels()" \
    && chown -R hetgate "$NUMBA_CACHE_DIR"

USER hetgate
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["hetgate", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "/etc/hetgate/config.yaml"]
