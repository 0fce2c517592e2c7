// Markdown to DOM nodes, safely: every piece of model text becomes a text node (textContent),
// never markup. Covers fenced code blocks, headings, lists, quotes, paragraphs, inline code,
// bold, italic and http(s) links.
"use strict";

(function () {
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // Inline spans: `code`, **bold**, *italic* / _italic_, [text](http://...).
  const INLINE = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)|(_[^_\s][^_]*_)|(\[[^\]]+\]\((https?:\/\/[^)\s]+)\))/;

  function inline(parent, text) {
    while (text.length) {
      const m = INLINE.exec(text);
      if (!m) { parent.appendChild(document.createTextNode(text)); return; }
      if (m.index > 0) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
      const s = m[0];
      if (m[1]) parent.appendChild(el("code", null, s.slice(1, -1)));
      else if (m[2]) inline(parent.appendChild(el("strong")), s.slice(2, -2));
      else if (m[3] || m[4]) inline(parent.appendChild(el("em")), s.slice(1, -1));
      else {
        const a = el("a", null, s.slice(1, s.indexOf("](")));
        a.href = m[6];
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        parent.appendChild(a);
      }
      text = text.slice(m.index + s.length);
    }
  }

  function render(text) {
    const root = el("div", "md");
    const lines = String(text).split("\n");
    let i = 0, para = null, list = null;
    const close = () => { para = null; list = null; };
    while (i < lines.length) {
      const line = lines[i];
      const fence = /^\s*(```|~~~)\s*([\w+-]*)\s*$/.exec(line);
      if (fence) {
        close();
        const code = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
        i++;  // the closing fence (or the end of a reply still streaming)
        const pre = el("pre", "code");
        if (fence[2]) pre.appendChild(el("span", "lang", fence[2]));
        pre.appendChild(el("code", null, code.join("\n")));
        root.appendChild(pre);
        continue;
      }
      const h = /^(#{1,6})\s+(.*)$/.exec(line);
      const li = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      const quote = /^>\s?(.*)$/.exec(line);
      if (!line.trim()) close();
      else if (h) { close(); inline(root.appendChild(el("h" + Math.min(h[1].length + 2, 6))), h[2]); }
      else if (li) {
        const ordered = /\d/.test(li[1]);
        if (!list || list.tagName !== (ordered ? "OL" : "UL")) { para = null; list = root.appendChild(el(ordered ? "ol" : "ul")); }
        inline(list.appendChild(el("li")), li[2]);
      } else if (quote) { close(); inline(root.appendChild(el("blockquote")), quote[1]); }
      else {
        list = null;
        if (!para) para = root.appendChild(el("p"));
        else para.appendChild(document.createElement("br"));
        inline(para, line);
      }
      i++;
    }
    return root;
  }

  window.pagedllmMarkdown = { render: render };
})();
