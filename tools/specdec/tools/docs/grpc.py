"""The gRPC API reference page, generated from the comments in protos/specdec/v1/*.proto.

protoc (grpc_tools) compiles the protos into a FileDescriptorSet with source info; every
service, RPC, message, field, oneof, enum and enum value is rendered with the comment above
it. A small generator of the project's own: no protoc plugin binary to install.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

from specdec.tools.docs.common import banner, cell, prose

PROTO_DIR = Path("protos")
PACKAGE_DIR = PROTO_DIR / "specdec" / "v1"

# FieldDescriptorProto.Type -> the name written in a .proto file
SCALARS = {
    number: name[len("TYPE_") :].lower()
    for name, number in descriptor_pb2.FieldDescriptorProto.Type.items()
}
# Source-info path tags (descriptor.proto field numbers)
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2


def proto_files(root: Path) -> list[Path]:
    return sorted((root / PACKAGE_DIR).glob("*.proto"))


def descriptor_set(root: Path) -> descriptor_pb2.FileDescriptorSet:
    """The protos compiled by grpc_tools' protoc, with their comments (source info)."""
    files = proto_files(root)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.pb"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                "-I.",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                *(str(f.relative_to(root / PROTO_DIR)) for f in files),
            ],
            check=True,
            cwd=root / PROTO_DIR,
        )
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


class _Comments:
    def __init__(self, f: descriptor_pb2.FileDescriptorProto):
        self.by_path = {
            tuple(loc.path): loc.leading_comments for loc in f.source_code_info.location
        }

    def __call__(self, *path: int) -> str:
        return self.by_path.get(tuple(path), "")


def _block(comment: str) -> list[str]:
    """A leading comment as Markdown: paragraphs, and indented (aligned) lines kept as text."""
    out: list[str] = []
    para: list[str] = []
    pre: list[str] = []

    def flush_para() -> None:
        if para:
            out.extend([prose(" ".join(para)), ""])
            para.clear()

    def flush_pre() -> None:
        if pre:
            out.extend(["```text", *pre, "```", ""])
            pre.clear()

    for raw in comment.splitlines():
        line = raw[1:] if raw.startswith(" ") else raw
        if line.startswith("  "):  # an aligned table or list inside the comment
            flush_para()
            pre.append(line.rstrip())
        elif not line.strip():
            flush_para()
            flush_pre()
        else:
            flush_pre()
            para.append(line.strip())
    flush_para()
    flush_pre()
    return out


def _type_name(field: descriptor_pb2.FieldDescriptorProto, package: str, types: dict) -> str:
    entry = types.get(field.type_name.lstrip("."))
    if entry is not None and entry.options.map_entry:
        key, value = entry.field
        return f"map&lt;{_type_name(key, package, types)}, {_type_name(value, package, types)}&gt;"
    if field.type_name:
        name = field.type_name.lstrip(".")
        short = name[len(package) + 1 :] if name.startswith(package + ".") else name
        return f"[`{short}`](#{anchor(name)})" if name.startswith(package + ".") else f"`{short}`"
    return f"`{SCALARS[field.type]}`"


def anchor(full_name: str) -> str:
    return full_name.replace(".", "-").lower()


def render(root: Path) -> str:
    fds = descriptor_set(root)
    files = [f for f in fds.file if f.package.startswith("specdec.")]
    package = files[0].package
    types = {}  # full name -> DescriptorProto, nested ones included
    for f in files:
        stack = [(f"{f.package}.{m.name}", m) for m in f.message_type]
        while stack:
            name, m = stack.pop()
            types[name] = m
            stack.extend((f"{name}.{n.name}", n) for n in m.nested_type)
    lines = [
        banner("the comments in `protos/specdec/v1/*.proto`"),
        "# gRPC API",
        "",
        f"Package `{package}`, one file per service plus `common.proto`. The protos are the only "
        "definition of the wire format; the Python stubs in `sdk/specdec/v1/` are generated "
        "from them (`make proto`). Every service also serves `grpc.health.v1` and gRPC server "
        "reflection (v1 and v1alpha).",
        "",
        "| file | services | messages | enums |",
        "| --- | --- | --- | --- |",
    ]
    for f in files:
        services = ", ".join(f"[`{s.name}`](#{anchor(package + '.' + s.name)})" for s in f.service)
        lines.append(
            f"| [`{Path(f.name).name}`](#{anchor(Path(f.name).stem + '-proto')}) "
            f"| {services} "
            f"| {len(_all_messages(f.message_type))} "
            f"| {len(f.enum_type) + sum(len(m.enum_type) for m in _all_messages(f.message_type))} |"
        )
    for f in files:
        comments = _Comments(f)
        stem = Path(f.name).stem
        lines += ["", f"## `{Path(f.name).name}` {{#{anchor(stem + '-proto')}}}", ""]
        for si, service in enumerate(f.service):
            full = f"{package}.{service.name}"
            lines += [f"### {service.name} {{#{anchor(full)}}}", ""]
            lines += _block(comments(FILE_SERVICE, si))
            lines += ["| RPC | request | response | description |", "| --- | --- | --- | --- |"]
            for mi, method in enumerate(service.method):
                req = _ref(method.input_type, package, method.client_streaming)
                resp = _ref(method.output_type, package, method.server_streaming)
                desc = cell(comments(FILE_SERVICE, si, SERVICE_METHOD, mi))
                lines.append(f"| `{method.name}` | {req} | {resp} | {desc} |")
            lines.append("")
        for mi, message in enumerate(f.message_type):
            lines += _message(message, package, package, comments, (FILE_MESSAGE, mi), types)
        for ei, enum in enumerate(f.enum_type):
            lines += _enum(enum, package, comments, (FILE_ENUM, ei))
    return "\n".join(lines).rstrip("\n") + "\n"


def _ref(type_name: str, package: str, stream: bool) -> str:
    name = type_name.lstrip(".")
    short = name[len(package) + 1 :]
    link = f"[`{short}`](#{anchor(name)})"
    return f"stream {link}" if stream else link


def _all_messages(messages) -> list:
    out = []
    for m in messages:
        out.append(m)
        out.extend(_all_messages(m.nested_type))
    return out


def _message(
    message, scope: str, package: str, comments: _Comments, path: tuple, types: dict
) -> list[str]:
    full = f"{scope}.{message.name}"
    title = full[len(package) + 1 :]
    lines = [f"### {title} {{#{anchor(full)}}}", ""]
    lines += _block(comments(*path))
    oneofs = {
        i: o.name
        for i, o in enumerate(message.oneof_decl)
        if not any(f.proto3_optional and f.oneof_index == i for f in message.field)
    }
    if message.field:
        lines += ["| field | type | number | description |", "| --- | --- | --- | --- |"]
        for fi, field in enumerate(message.field):
            entry = types.get(field.type_name.lstrip("."))
            label = (
                ""
                if entry is not None and entry.options.map_entry
                else "repeated "
                if field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                else ("optional " if field.proto3_optional else "")
            )
            desc = cell(comments(*path, MESSAGE_FIELD, fi))
            if field.HasField("oneof_index") and field.oneof_index in oneofs:
                desc = f"(oneof `{oneofs[field.oneof_index]}`) {desc}"
            lines.append(
                f"| `{field.name}` | {label}{_type_name(field, package, types)} | {field.number} | {desc} |"
            )
        lines.append("")
    else:
        lines += ["No fields.", ""]
    for ni, nested in enumerate(message.nested_type):
        if nested.options.map_entry:
            continue
        lines += _message(nested, full, package, comments, (*path, MESSAGE_NESTED, ni), types)
    for ei, enum in enumerate(message.enum_type):
        lines += _enum(enum, full, comments, (*path, MESSAGE_ENUM, ei), package)
    return lines


def _enum(enum, scope: str, comments: _Comments, path: tuple, package: str = "") -> list[str]:
    full = f"{scope}.{enum.name}"
    package = package or scope
    title = full[len(package) + 1 :]
    lines = [f"### {title} {{#{anchor(full)}}}", ""]
    lines += _block(comments(*path))
    lines += ["| value | number | description |", "| --- | --- | --- |"]
    for vi, value in enumerate(enum.value):
        desc = cell(comments(*path, ENUM_VALUE, vi))
        lines.append(f"| `{value.name}` | {value.number} | {desc} |")
    lines.append("")
    return lines
