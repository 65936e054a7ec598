"""One storage root for checkpoints and trajectories: a local folder or any pyarrow.fs URI (s3://, gs://).

Engines (DeepSpeed, vLLM) read and write local folders; these helpers move folders between a node's
disk and the storage root, so nothing assumes a filesystem shared between nodes.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs


def resolve_filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, for a local path or any pyarrow.fs URI."""
    text = str(path)
    if "://" in text:
        return pafs.FileSystem.from_uri(text)
    return pafs.LocalFileSystem(), str(Path(text).expanduser().resolve())


def upload_dir(local: Path, destination: str) -> None:
    filesystem, inner = resolve_filesystem(destination)
    filesystem.create_dir(inner, recursive=True)
    pafs.copy_files(
        str(local), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=filesystem
    )


def download_dir(source: str, local: Path) -> Path:
    filesystem, inner = resolve_filesystem(source)
    local.mkdir(parents=True, exist_ok=True)
    pafs.copy_files(
        inner, str(local), source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem()
    )
    return local


def list_dir_names(folder: str) -> list[str]:
    filesystem, inner = resolve_filesystem(folder)
    infos = filesystem.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return [info.base_name for info in infos if info.type == pafs.FileType.Directory]


def exists(path: str) -> bool:
    filesystem, inner = resolve_filesystem(path)
    return filesystem.get_file_info(inner).type != pafs.FileType.NotFound


def write_text(path: str, text: str) -> None:
    """The whole file or, after a crash mid-write, the one before: written beside it, then moved."""
    filesystem, inner = resolve_filesystem(path)
    folder, name = inner.rsplit("/", 1)
    filesystem.create_dir(folder, recursive=True)
    partial = f"{folder}/.{name}.partial"
    with filesystem.open_output_stream(partial) as stream:
        stream.write(text.encode())
    filesystem.move(partial, inner)


def read_text(path: str) -> str:
    filesystem, inner = resolve_filesystem(path)
    with filesystem.open_input_stream(inner) as stream:
        return stream.read().decode()


def delete_dir(path: str) -> None:
    filesystem, inner = resolve_filesystem(path)
    filesystem.delete_dir(inner)
