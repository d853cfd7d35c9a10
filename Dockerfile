FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e .
ENV RADIXFLOW_LOG_JSON=1
ENTRYPOINT ["radixflow"]
