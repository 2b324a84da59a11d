"""The viewer shows a turn's images beside its token strip: a thumbnail of each image whose
placeholder ids the turn's part of the sample holds, those ids marked in the strip, and the
image's bytes served from the log."""

from __future__ import annotations

import re

import httpx

from tests.proxy.fake_tokens import IMAGE_PAD, image_token_count
from tests.proxy.fixtures import RunningProxy
from tests.proxy.test_images import PNG_A, URL, chat, data_url, reply_of, sha, user


async def test_a_turns_images_are_thumbnails_beside_its_strip_with_their_placeholders_marked(
    vlm_proxy: RunningProxy, client: httpx.AsyncClient
) -> None:
    session = await vlm_proxy.new_session()
    messages = [user("what is in these", data_url(PNG_A), URL)]
    first = await chat(vlm_proxy, session, messages)
    messages += [reply_of(first), user("and now")]
    assert (await chat(vlm_proxy, session, messages)).status_code == 200
    assert (await vlm_proxy.finish(session["session_id"])).status_code == 200
    sid = session["session_id"]

    body = (await client.get(f"/sessions/{sid}/turns/0")).text
    thumbs = re.findall(r'<figure class="thumb" data-image="(\d)" data-sha256="(\w+)" '
                        r'data-start="(\d+)" data-end="(\d+)"', body)  # fmt: skip
    assert [(n, h) for n, h, _, _ in thumbs] == [("0", sha(PNG_A)), ("1", sha(URL))]
    for n, _, start, end in thumbs:  # each run marked in the strip, as long as the image's
        marked = re.findall(rf'<span class="t m0 img" data-image="{n}" data-id="(\d+)"', body)
        assert len(marked) == int(end) - int(start)
        assert set(marked) == {str(IMAGE_PAD)}
    assert int(thumbs[0][3]) - int(thumbs[0][2]) == image_token_count(data_url(PNG_A))
    assert f'src="/sessions/{sid}/images/{sha(PNG_A)}"' in body
    assert f'href="{URL}"' in body  # a URL image is the URL's: never fetched

    # The second turn brought no image: its part of the strip has none.
    assert 'class="thumb"' not in (await client.get(f"/sessions/{sid}/turns/1")).text

    image = await client.get(f"/sessions/{sid}/images/{sha(PNG_A)}")
    assert image.status_code == 200
    assert (image.content, image.headers["content-type"]) == (PNG_A, "image/png")
    assert (await client.get(f"/sessions/{sid}/images/{'0' * 64}")).status_code == 404
    assert (await client.get(f"/sessions/{sid}/images/nope")).status_code == 400
