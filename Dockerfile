# syntax=docker/dockerfile:1
# sits' container image, two targets:
#   docker build --target gpu -t sits:gpu .   CUDA runtime base, the CUDA build of torch
#   docker build --target cpu -t sits:cpu .   slim Python base, the CPU build of torch
# Both install sits as scripts/install.sh does: a venv, torch first (install.sh's torch
# requirement for its case), then `pip install` of this source tree (without the dev extras: the
# tests do not run in the image). ENTRYPOINT is `sits serve`; `sits router` runs with
# `command: ["sits", "router"]` (deploy/k8s).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/sits
RUN python3 -m venv /opt/sits/.venv
ENV PATH=/opt/sits/.venv/bin:$PATH
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . \
    && useradd --create-home --uid 10001 --user-group sits
USER 10001
EXPOSE 8000
ENTRYPOINT ["sits", "serve", "--host", "0.0.0.0"]

FROM ${CUDA_IMAGE} AS gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/sits
RUN python3 -m venv /opt/sits/.venv
ENV PATH=/opt/sits/.venv/bin:$PATH
RUN pip install "torch>=2.11"
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . \
    && useradd --create-home --uid 10001 --user-group sits
USER 10001
EXPOSE 8000
ENTRYPOINT ["sits", "serve", "--host", "0.0.0.0"]
