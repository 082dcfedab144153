"""English text for the speech-recognition round trip (``tests/test_fidelity.py``, ``benchmarks/fidelity.py``).

Plain words only: no digits, no abbreviations, no names a small recognizer would have to guess the
spelling of, so that a word the recognizer misses is a word the audio did not say clearly, not a
spelling choice (``ttsq.testing.fidelity.normalize`` turns digits into words anyway, for the recognizer's side).
Every sentence is distinct: a chunk of the document is never the same text as another chunk, so a
stitch that drops, repeats or swaps one is a change in the words. The Korean sentences
(``KOREAN_SENTENCES``) follow the same rules; the benchmark also scores them by characters
(``ttsq.testing.fidelity.check_characters``).
"""

from __future__ import annotations

#: The fixed corpus of ``benchmarks/fidelity.py``: short sentences of everyday English.
SENTENCES = (
    "The queue was quiet that morning, and every job finished before lunch.",
    "She opened the window and listened to the rain falling on the garden.",
    "A long train crossed the bridge while the river ran fast below it.",
    "Please bring a warm coat, because the evening will be cold and windy.",
    "The old library keeps its maps in a room at the top of the stairs.",
    "He painted the kitchen door green and left the brushes in the sink.",
    "We walked along the beach until the sun went down behind the hills.",
    "The small dog barked at the postman and then ran back into the house.",
    "Fresh bread and hot soup were waiting on the table when they came home.",
    "The teacher asked the children to read the story aloud, one page each.",
    "A strong wind blew the leaves across the road and into the field.",
    "My brother fixed the bicycle and rode it to the market in the village.",
    "The doctor told him to drink more water and to sleep a little longer.",
    "Clouds gathered over the mountains, and soon the first snow began to fall.",
    "They sold apples, cheese and honey from a wooden cart by the church.",
    "The captain checked the weather before the ship left the harbor at dawn.",
)

#: The long document of the round trip: more than fifteen hundred words in paragraphs.
DOCUMENT = """\
The village sat at the edge of a wide green valley, where a slow river bent around the hills. In the \
summer the fields were full of wheat, and in the winter the roads were white with snow. Most people \
worked on the farms, but a few kept small shops along the main street. There was a baker, a butcher, \
a man who mended shoes, and a woman who sold books and paper. Every morning the church bell rang once, \
and the children ran down the lane to the school beside the old stone bridge.

The baker was the first to wake. Long before the sun came up, he lit the fire in his oven and mixed the \
flour with water and salt. He liked the quiet of the early hours, when the only sound was the wind in \
the chimney. By the time the sky turned gray, the smell of fresh bread had spread across the square. \
Farmers stopped at his door on their way to the fields, and they always asked him about the weather, \
as if a baker could know more about the clouds than anyone else.

One autumn a stranger arrived on the evening train. He carried a leather bag and a long wooden case, \
and he asked the station master where he could find a room for the night. The station master sent him \
to the inn at the top of the hill, where the owner gave him a small room under the roof. From the \
window he could see the whole valley, the river shining in the moonlight, and the dark shape of the \
forest beyond the last farm.

In the morning the stranger opened the wooden case and took out a violin. He sat on a bench in the \
square and began to play. The music was gentle at first, then quick and bright, like water running \
over stones. People stopped on their way to work. The butcher came out of his shop with his apron \
still on, and the woman from the book shop left her door open so that she could hear. When the last \
note faded, nobody spoke for a moment, and then everyone clapped.

After that the stranger played in the square every day. He never asked for money, but people left \
apples, cheese and bread beside him on the bench. The children followed him through the streets and \
tried to whistle his songs. Some of the older farmers said that music would not fill a barn or feed a \
cow, yet even they were seen tapping their boots on the ground when they thought no one was looking.

Winter came early that year. A heavy storm closed the road over the mountains, and for two weeks no \
cart could reach the valley. The shops began to run out of sugar, oil and lamp wax. The baker used the \
last of his flour carefully, baking smaller loaves so that every family would have something on the \
table. At night the wind howled around the houses, and the river froze so hard that the boys could \
walk across it without fear.

During the storm the stranger did not stay in his room. He walked from farm to farm through the deep \
snow, carrying wood for the old people who could not leave their homes. In the evenings he played for \
them by the fire, and they told him stories about the valley in the days before the railway, when the \
only way to the city was a long journey by horse. He listened carefully and wrote some of the stories \
in a small notebook with a green cover.

When the road finally opened, a line of carts came down from the pass, loaded with flour, coal and \
salt. The whole village gathered in the square to meet them. The drivers were surprised to find \
everyone singing, and they were even more surprised when a man with a violin climbed onto a barrel \
and played a tune they had known since they were children. That night there was a dinner in the \
church hall, with soup, roasted potatoes and a cake the baker had made from the first new flour.

In the spring the fields turned green again, and the river ran high with water from the melting \
snow. The stranger told the innkeeper that it was time for him to go. He had come to the valley to \
rest for a few days, he said, but the place had kept him for a whole season. The innkeeper asked him \
where he would go next. He smiled and said that he did not know yet, because the best journeys begin \
without a plan.

On his last morning the children of the school waited for him at the station. Each of them had \
brought something small: a painted stone, a paper bird, a drawing of the bridge. He thanked them one \
by one and put every gift carefully into his leather bag. Then he opened the wooden case for the last \
time and played the first song he had ever played in the square. The train whistle sounded, the doors \
closed, and the music was carried away down the valley.

Years later the woman from the book shop received a parcel from a city far to the south. Inside was a \
book with a green cover, full of the stories the old people had told by the fire. Every story was \
written down exactly as it had been spoken, with the names of the farms and the rivers and the hills. \
On the first page there was a short letter. The stranger wrote that he had never found another place \
where people listened so well, and that he hoped the book would help the children remember.

The woman put the book in the window of her shop, and soon the whole village came to read it. The \
baker found the story of his grandfather, who had once carried bread across the frozen river on a \
sledge. The butcher read about a summer when the river ran dry and the cows drank from the church \
well. The children laughed at the story of a goat that climbed onto the roof of the school and would \
not come down until the teacher played a song on an old wooden flute.

Now, when visitors come to the valley, they sometimes ask why there is a bench in the square with a \
small brass plate on it. The plate does not carry a name. It only says that music was played there \
during the long winter, and that the village was warmer for it. On summer evenings young people sit on \
the bench with guitars and fiddles, and the old people bring their chairs out into the street to \
listen, just as their parents did when the stranger played.

Spring also brought the first visitors of the year. A painter set up his easel beside the river and \
spent a week trying to catch the color of the water in the early light. A family from the city rented \
the empty cottage behind the mill, and their two daughters learned to milk a cow and to ride a bicycle \
down the steep lane without using the brakes. An old professor came to study the birds that nested in \
the reeds, and he sat so still for so many hours that the herons stopped being afraid of him.

The teacher decided that the school should keep its own book of stories. Each child was asked to find \
one story at home, from a parent or a grandparent, and to write it down in careful handwriting. Some \
stories were funny and some were sad. One boy wrote about a flood that had carried a piano all the way \
down the river to the next town. A girl wrote about her grandmother, who had walked across the \
mountains in a snowstorm to fetch medicine for a sick neighbor and came back with a lost lamb as well.

Every year, on the first day of spring, the village now holds a small festival in the square. The \
baker makes honey cakes, the farmers bring cider and cheese, and the school children read their \
stories aloud from the steps of the church. In the evening there is music and dancing until late, \
and the lanterns hang from the trees like little moons. Nobody remembers exactly who started the \
festival, but everyone agrees that it began in the year the stranger came.

The bridge still stands, though the railway has grown and the trains are faster now. The school has \
new windows and a larger yard, and the baker's grandson runs the shop with his own children. Yet every \
morning the church bell still rings once, and before the sun comes up, someone still lights the fire \
in the old oven. The smell of fresh bread still spreads across the square, and the farmers still stop \
at the door to ask about the weather.

If you walk to the top of the hill at dusk, past the inn and the last of the houses, you can see the \
whole valley below you. The river shines between the fields, the forest is dark against the sky, and \
the lights come on one by one in the windows. It is a quiet place, and nothing much happens there. \
But the people who live in it will tell you, if you ask them, that a small place can hold a great many \
stories, as long as someone is willing to listen and to write them down.
"""

#: The Korean corpus of ``benchmarks/fidelity.py --languages ko``: short sentences of everyday Korean,
#: polite endings, no digits (a recognizer may write a number word either way), no loanwords a
#: recognizer would have to guess the spelling of.
KOREAN_SENTENCES = (
    "오늘 아침에는 비가 조용히 내렸습니다.",
    "저는 매일 아침 공원에서 산책을 합니다.",
    "할머니께서 맛있는 김치찌개를 끓여 주셨어요.",
    "버스가 늦게 와서 회사에 조금 늦었어요.",
    "주말에 친구들과 함께 영화를 보러 갔습니다.",
    "창문을 열면 시원한 바람이 들어옵니다.",
    "도서관은 저녁 늦게까지 문을 엽니다.",
    "시장에서 사과와 배를 조금 샀어요.",
    "아이들이 운동장에서 즐겁게 뛰어놀고 있습니다.",
    "내일은 날씨가 맑고 따뜻하겠습니다.",
    "따뜻한 차를 마시면서 신문을 읽었어요.",
    "강아지가 문 앞에서 주인을 기다리고 있어요.",
    "겨울이 오기 전에 두꺼운 옷을 준비하세요.",
    "우리는 기차를 타고 바닷가 마을로 여행을 떠났습니다.",
    "선생님께서 학생들에게 책을 소리 내어 읽으라고 하셨습니다.",
    "저녁을 먹은 뒤에 가족과 함께 이야기를 나눴어요.",
)
