# hetgate gateway image: `docker build -t hetgate .` then
#   docker run -p 8000:8000 -v $PWD/my-config.yaml:/etc/hetgate/config.yaml hetgate
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /opt/hetgate
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY scoring ./scoring
COPY kvindex ./kvindex
COPY bench ./bench
COPY configs ./configs
# A regular install: the wheel carries configs/ (as the package hetgate_configs) and the traces.
RUN pip install --no-cache-dir . \
    && useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin hetgate

USER hetgate
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["hetgate", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--config", "/etc/hetgate/config.yaml"]
