// Tool calls through lockstep serve with the official openai client, against
// the synthetic tool-echo model of tests/test_server_tools.c (it always
// answers an assistant turn with one get_weather call). Prints PASS/FAIL lines;
// exits non-zero if any check failed.
import OpenAI from 'openai';
import assert from 'node:assert/strict';

const baseURL = process.argv[2];
const client = new OpenAI({ baseURL, apiKey: 'none', maxRetries: 0 });
const tools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
}];
const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
let failed = 0;

async function check(name, fn) {
  try {
    await fn();
    console.log(`PASS ${name}`);
  } catch (e) {
    failed++;
    console.log(`FAIL ${name}`);
    console.log(`  ${String(e && e.stack || e).split('\n').slice(0, 6).join('\n  ')}`);
  }
}

let withTools;
await check('tools_call_returned', async () => {
  const r = await client.chat.completions.create({ model: 'tool-echo', messages: ask, tools, temperature: 0 });
  withTools = r;
  const c = r.choices[0];
  assert.equal(c.finish_reason, 'tool_calls');
  assert.equal(c.message.content, null);
  assert.equal(c.message.tool_calls.length, 1);
  const call = c.message.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.match(call.id, /^call_[0-9a-f]+$/);
  assert.equal(call.function.name, 'get_weather');
  assert.deepEqual(JSON.parse(call.function.arguments), { city: 'Paris' });
});

await check('tools_rendered_into_prompt', async () => {
  const r = await client.chat.completions.create({ model: 'tool-echo', messages: ask, temperature: 0, max_tokens: 8 });
  // the template writes the tool definitions into the system prompt
  assert.ok(withTools.usage.prompt_tokens > r.usage.prompt_tokens + 50,
    `prompt tokens with tools ${withTools.usage.prompt_tokens}, without ${r.usage.prompt_tokens}`);
});

await check('no_tools_plain_content', async () => {
  const r = await client.chat.completions.create({ model: 'tool-echo', messages: ask, temperature: 0 });
  const c = r.choices[0];
  assert.equal(c.finish_reason, 'stop');
  assert.equal(c.message.tool_calls, undefined);
  assert.equal(c.message.content,
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>');
});

await check('tool_choice_none_plain_content', async () => {
  const r = await client.chat.completions.create({ model: 'tool-echo', messages: ask, tools, tool_choice: 'none', temperature: 0 });
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.match(r.choices[0].message.content, /^<tool_call>/);
});

await check('tools_streamed', async () => {
  const stream = await client.chat.completions.create({ model: 'tool-echo', messages: ask, tools, temperature: 0, stream: true });
  let content = '', calls = [], finish = null, role = null;
  for await (const chunk of stream) {
    const ch = chunk.choices[0];
    if (!ch) continue;
    if (ch.delta.role) role = ch.delta.role;
    if (ch.delta.content) content += ch.delta.content;
    if (ch.delta.tool_calls) calls.push(...ch.delta.tool_calls);
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  assert.equal(role, 'assistant');
  assert.equal(content, '', 'the call must not leak into the streamed text');
  assert.equal(finish, 'tool_calls');
  assert.equal(calls.length, 1);
  assert.equal(calls[0].index, 0);
  assert.equal(calls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(calls[0].function.arguments), { city: 'Paris' });
});

await check('tool_result_turn', async () => {
  const call = withTools.choices[0].message.tool_calls[0];
  const r = await client.chat.completions.create({
    model: 'tool-echo', tools, temperature: 0,
    messages: [...ask, { role: 'assistant', content: null, tool_calls: [call] },
      { role: 'tool', tool_call_id: call.id, content: '{"temp_c": 21}' }],
  });
  // the template renders the call and its result; the model answers with its call again
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.ok(r.usage.prompt_tokens > withTools.usage.prompt_tokens);
});

await check('tools_malformed_is_400', async () => {
  await assert.rejects(
    client.chat.completions.create({ model: 'tool-echo', messages: ask, tools: [{ type: 'function' }] }),
    (e) => e.status === 400 && /tools\[0\]/.test(e.message));
});

process.exit(failed ? 1 : 0);
