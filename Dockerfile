FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY fairgate ./fairgate
RUN pip install --no-cache-dir .
EXPOSE 8080
CMD ["fairgate", "serve", "--host", "0.0.0.0"]
